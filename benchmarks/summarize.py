"""Markdown tables for RESULTS.md from the JSON files `throughput.py --json` wrote.

python benchmarks/summarize.py benchmarks/logs/throughput/5m_fp32_g4.json ... \\
    [--scaling benchmarks/logs/concurrency/5m_fp32.json ...]
    [--live COMMIT]    # name the live tree's commit in the labels
"""

from __future__ import annotations

import argparse
import json


def fmt(x: float) -> str:
    return f"{x:,.0f}"


def throughput_tables(paths: list[str]) -> str:
    lines = [
        "| model, dtype, workload | system | tok/s (CPU time) | tok/s (wall) | ours is x faster (CPU) | useful GFLOP/s "
        "| % of matmul peak | executed GFLOP/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    checks = [
        "| model, dtype, G | pair | exact match | mean matched prefix | requests | first divergences re-scored in fp32 "
        "|",
        "|---|---|---|---|---|---|",
    ]
    for path in paths:
        d = json.load(open(path))
        a = d["args"]
        peak = d["peaks"][a["dtype"]][1]
        rows = d["rows"]
        ours = next(r for r in rows if r["system"] == "ours")
        tag = (f"{a['model']} {a['dtype']}, {a['prompts']} prompts x G={a['group']}"
               f"{', median of ' + str(a['reps']) if a['reps'] > 1 else ''}")
        for r in rows:
            ratio = "-" if r is ours else f"{ours['tok_s_cpu'] / r['tok_s_cpu']:.2f}x"
            ex = f"{r['executed_flops_cpu'] / 1e9:.1f}" if r.get("executed_flops_cpu") else "-"
            lines.append(f"| {tag} | {label(r['system'])} | {fmt(r['tok_s_cpu'])} | {fmt(r['tok_s_wall'])} | {ratio} | "
                         f"{r['useful_flops_cpu'] / 1e9:.1f} | {r['useful_flops_cpu'] / peak:.1%} | {ex} |")
            tag = ""
        tag = f"{a['model']} {a['dtype']} G={a['group']}"
        for k, v in d["checks"].items():
            if k.endswith("fp32 greedy agreement"):
                checks.append(f"| {tag} | {label(k.split(':')[0])}: tokens that are the fp32 argmax given their own "
                              f"prefix | {v['agree']:.1%} | - | {v['tokens']} tokens | off by median "
                              f"{v['gap_median']:.2f} / max {v['gap_max']:.2f} logits |")
                tag = ""
                continue
            if k.endswith("first divergences") or v is None:
                continue
            if not (k.startswith("ours") or "unbatched" in k and k.startswith("generate")) and "hf_cb vs generate" != k:
                continue
            div = d["checks"].get(f"{k}: first divergences")
            dtxt = "-"
            if div:
                dtxt = (f"{div['n']}: gap {div['gap_median']:.2f} median / {div['gap_max']:.2f} max vs typical margin "
                        f"{div['top2_gap_median']:.2f}")
            checks.append(f"| {tag} | {k} | {v[0]:.0%} | {v[1]:.0%} | {v[2]} | {dtxt} |")
            tag = ""
    return "\n".join(lines) + "\n\n" + "\n".join(checks) + "\n"


LIVE: str | None = None  # --live: the commit the live tree was at when the JSON was written


def label(system: str) -> str:
    if system == "ours":
        return f"ours @ {LIVE[:7]}" if LIVE else "ours (live tree)"
    return {"hf_cb": "transformers CB (tuned)", "generate": "HF generate (padded)"}.get(system, system)


def scaling_table(path: str) -> str:
    d = json.load(open(path))
    a = d["args"]
    systems = [s for s in a["scaling_systems"].split(",") if s]
    peak = d["peaks"][a["dtype"]][1]
    title = (f"**{a['model']} {a['dtype']}**: each of N distinct {a['scaling_prompt_len']}-token prompts decodes "
             f"{a['scaling_new_tokens']} tokens; matmul peak {peak / 1e9:.0f} GFLOP/s per CPU-second\n\n")
    head = title + "| concurrent | " + " | ".join(label(s) + " tok/s" for s in systems) + " | ours GFLOP/s (% peak) |"
    lines = [head, "|" + "---|" * (len(systems) + 2)]
    for row in d["scaling"]:
        cells = " | ".join(f"{fmt(row[s])} ({fmt(row[s + '_wall'])})" for s in systems)
        lines.append(f"| {row['concurrency']} | {cells} | {row['ours_flops'] / 1e9:.1f} "
                     f"({row['ours_flops'] / peak:.0%}) |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="*")
    p.add_argument("--scaling", action="append", default=[])
    p.add_argument("--live", help="commit of the live tree the runs used")
    a = p.parse_args()
    global LIVE
    LIVE = a.live
    if a.runs:
        print(throughput_tables(a.runs))
    for path in a.scaling:
        print(scaling_table(path))


if __name__ == "__main__":
    main()
