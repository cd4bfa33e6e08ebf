"""The embedded model's training step on the CPU: glibc's allocator as `train_tiny_chat.py` sets it, against
its default (the baseline, in the same run).

Each trial is a fresh process training the recipe's model on a sample of the recipe's data for a few steps
(same data, seed and batch order in both arms); the arms alternate, so drift of the machine falls on both.
Reports seconds per step (median over the steps after the first few) and the ratio.

    python benchmarks/bench_train_step.py [--steps 40] [--trials 2] [--conversations 2000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
WARM = 5  # the first steps allocate for the first time in both arms

# the baseline calls train() without main()'s allocator setting; the other arm is the command users run
ARM_CODE = {
    "glibc default": "import sys; sys.path.insert(0, {scripts!r}); import train_tiny_chat as t; "
                     "t.train(t.parser().parse_args({argv!r}))",
    "keep freed memory": "import sys; sys.path.insert(0, {scripts!r}); import train_tiny_chat as t; "
                         "sys.exit(t.main({argv!r}))",
}


def seconds_per_step(arm: str, argv: list[str], out: Path) -> float:
    code = ARM_CODE[arm].format(scripts=str(SCRIPTS), argv=argv)
    subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = json.loads((out / "train_log.json").read_text())["stages"][0]["log"]
    times = [row["seconds"] for row in log]
    return statistics.median(b - a for a, b in zip(times[WARM:], times[WARM + 1:]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--trials", type=int, default=2, help="trials per arm, alternating")
    p.add_argument("--conversations", type=int, default=2000)
    args = p.parse_args()
    results: dict[str, list[float]] = {arm: [] for arm in ARM_CODE}
    with tempfile.TemporaryDirectory() as tmp:
        for trial in range(args.trials):
            for arm in ARM_CODE:
                out = Path(tmp) / f"{trial}-{arm.replace(' ', '_')}"
                argv = ["--out", str(out), "--conversations", str(args.conversations), "--bpe-conversations",
                        str(min(3000, args.conversations)), "--stop-at", str(args.steps)]
                results[arm].append(seconds_per_step(arm, argv, out))
                print(f"trial {trial} {arm}: {results[arm][-1]:.3f} s/step", flush=True)
    base = statistics.median(results["glibc default"])
    print(f"\n| allocator | s/step (median of {args.trials}) | vs default |\n|---|---|---|")
    for arm, values in results.items():
        print(f"| {arm} | {statistics.median(values):.3f} | {statistics.median(values) / base:.2f}x |")


if __name__ == "__main__":
    main()
