"""Two commits' engines side by side: the in-process engine loop (`inprocess_engine.py`: the
target worker's EngineLoop on the demo target, plain, no network) of each source tree, run in
alternating order, each in a fresh process that imports that tree's `src/`. For host-side
changes whose gain is a few per cent on this noisy machine: the rounds alternate, so a slow
phase of the machine falls on both.

    git worktree add /tmp/before HEAD~1
    python bench/bench_ab.py --trees /tmp/before,. --streams 16 --tokens 384 --rounds 2

Writes <out>/ab.json: each run's tok/s by tree and load, and the ratio of the pooled means.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from common import parser

RUN = """
import json, sys
from pathlib import Path
tree = Path(sys.argv[1]).resolve()
sys.path[:0] = [str(tree / "src"), str(tree / "bench")]
import inprocess_engine as ie
from specserve.tooling.modelbuild.build import find_pair, load_eval_prompts
pair = find_pair(sys.argv[2])
prompts = [p["prompt"] for p in load_eval_prompts(pair)]
cells = ie.measure(pair, prompts, [int(x) for x in sys.argv[3].split(",")], int(sys.argv[4]), int(sys.argv[5]),
                   sys.argv[6], 2)
print("AB " + json.dumps({c["streams"]: c["tok_s"] for c in cells}))
"""


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--trees", required=True, help="two source trees, comma-separated: before,after")
    ap.add_argument("--streams", default="16")
    ap.add_argument("--requests", type=int, default=2, help="requests per stream, one after another")
    ap.add_argument("--tokens", type=int, default=384)
    ap.add_argument("--mode", choices=("invariant", "fast"), default="invariant")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    trees = a.trees.split(",")
    runs: dict[str, list[dict]] = {t: [] for t in trees}
    models = str(Path(a.models).resolve())
    for r in range(a.rounds):
        for t in trees if r % 2 == 0 else trees[::-1]:
            out = subprocess.run([sys.executable, "-c", RUN, t, models, a.streams, str(a.requests), str(a.tokens),
                                  a.mode], capture_output=True, text=True, timeout=1800, check=True).stdout
            got = json.loads(next(line for line in out.splitlines() if line.startswith("AB "))[3:])
            runs[t].append(got)
            print(f"round {r} {t}: {got}", flush=True)
    before, after = trees
    ratio = {s: (sum(x[s] for x in runs[after]) / len(runs[after])) / (sum(x[s] for x in runs[before])
                                                                         / len(runs[before]))
             for s in runs[before][0]}
    print(f"after / before tok/s: {ratio}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ab.json").write_text(json.dumps({"args": vars(a), "runs": runs, "after_over_before": ratio}, indent=1))


if __name__ == "__main__":
    main()
