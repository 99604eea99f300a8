"""Loading a GGUF checkpoint: from the GGUF file each time (``MECHDIFF_CACHE=off``), the first load through the
conversion cache (it converts), and a later load (it reads the conversion). Each in its own process, so nothing is
shared between them; the fingerprints must agree.

    python benchmarks/gguf_load.py smollm2-135m --repeat 2
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

CHILD = (
    "import sys, time; from mechdiff.models.loading import load_model; t = time.perf_counter(); "
    "m = load_model(sys.argv[1]); print(time.perf_counter() - t, m.fingerprint)"
)


def timed(model: str, cache: str) -> tuple[float, str]:
    """Seconds to ``load_model(model)`` in a fresh process with ``MECHDIFF_CACHE=cache``, and the fingerprint."""
    env = {**os.environ, "MECHDIFF_CACHE": cache}
    out = subprocess.run([sys.executable, "-c", CHILD, model], env=env, capture_output=True, text=True, check=True)
    seconds, fingerprint = out.stdout.split()[-2:]
    return float(seconds), fingerprint


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default="smollm2-135m")
    p.add_argument("--repeat", type=int, default=2, help="loads of each kind after the first")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        rows = [("GGUF file", timed(args.model, "off")) for _ in range(args.repeat)]
        rows.append(("first through the cache (converts)", timed(args.model, cache)))
        rows += [("later through the cache", timed(args.model, cache)) for _ in range(args.repeat)]
    for what, (seconds, fingerprint) in rows:
        print(f"{what:36s} {seconds:6.1f} s   fingerprint {fingerprint}")
    if len({f for _, (_, f) in rows}) != 1:
        raise SystemExit("the fingerprints differ")
    direct = [s for w, (s, _) in rows if w == "GGUF file"]
    later = [s for w, (s, _) in rows if w.startswith("later")]
    print(f"later load / GGUF-file load: {sum(later) / len(later) / (sum(direct) / len(direct)):.2f}")


if __name__ == "__main__":
    main()
