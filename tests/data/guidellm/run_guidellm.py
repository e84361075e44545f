"""Writes real-constant.json and real-poisson.yaml: guidellm 0.7.3 run
against the tiny CPU engine (README.md). Run from the repository root with
`PYTHONPATH=. python tests/data/guidellm/run_guidellm.py OUT_FOLDER`, after
`llmsim engine install --cpu` and `llmsim loadtest install guidellm`."""
import sys
import tempfile
import time
from pathlib import Path

from validate import engine as E, loadtest as L
from validate.tokenizer import write_tokenizer

RUNS = {"real-constant.json": ("constant", [2.0, 4.0, 8.0]), "real-poisson.yaml": ("poisson", [3.0, 6.0])}
REQUESTS, PROMPT, OUTPUT, PREFIX = 24, 256, 32, 256


def main(out: Path, only: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="guidellm-run-"))
    server_tok = write_tokenizer(tmp / "tokenizer", E.TINY_MODEL)
    client_tok = write_tokenizer(tmp / "tokenizer-spelling", E.TINY_MODEL, spell=True)
    t0 = time.monotonic()
    with E.start_cpu(tokenizer=server_tok) as eng:
        print(f"[{time.monotonic() - t0:4.0f} s] engine up at {eng.url}", file=sys.stderr)
        for name, (profile, rates) in RUNS.items():
            if only and name not in only:
                continue
            flags = L.guidellm_args(eng.url, client_tok, out / name, profile, rates, REQUESTS, PROMPT, OUTPUT,
                                    PREFIX)
            print(f"[{time.monotonic() - t0:4.0f} s] guidellm run {' '.join(flags)}", file=sys.stderr)
            L.run_guidellm(flags)
    print(f"[{time.monotonic() - t0:4.0f} s] done", file=sys.stderr)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
