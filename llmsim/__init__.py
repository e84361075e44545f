"""The `llmsim` command line: one module per command group (`model_cmds`,
`experiment_cmds`, `calibrate_cmds`, `validate_cmds`) over the model (`sim`),
calibration (`calibrate`) and the live harness (`validate`). Nothing imports
this package."""
