"""What a tree step costs on this CPU: `medusa-chat step-cost` (medusa_chat/bench/step_cost.py, where its options and
method are described), runnable from a checkout as before:

    python benchmarks/step_cost.py                                   # the embedded model, 1 and 2 threads
    python benchmarks/step_cost.py --model llama-1b-Q4_K_M.gguf --threads 2 --json out.json
"""

from __future__ import annotations

import argparse

from medusa_chat.bench.step_cost import add_arguments, command_line, run

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    args = ap.parse_args()
    raise SystemExit(run(args, command_line("python benchmarks/step_cost.py", args)))
