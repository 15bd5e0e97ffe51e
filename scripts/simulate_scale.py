"""A day of bursty traffic against autoscaled replicas, under each autoscaling policy of `pipeline deploy
kubernetes`: tokens/s, ITL, replicas, GPU-hours and dollars per million output tokens.

    python scripts/simulate_scale.py                          # Llama-3.3-70B FP8 + EAGLE-3 on 2 x H100 (a roofline)
    python scripts/simulate_scale.py --cost-model engines/smollm2-135m/engine --gpus 0 --peak-rps 2
    python scripts/simulate_scale.py --json --plot docs/img/scale-sim.png

The replica is either a GPU profile (a roofline from the memory plan: one GPU's weight reads at 80% of its
bandwidth, or the FLOPs at 25% of its dense FP8 peak) or a cost model `pipeline bench` / the build measured
(cost_model.json in an engine folder). The model itself: pipeline/deploy/simulate.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# H100 SXM: 1,979 dense FP8 TFLOPS (3,958 with sparsity), NVIDIA's H100 datasheet. Decode GEMMs are skinny and
# attention isn't free: a quarter of that peak is assumed reached (an assumption, not a measurement; `pipeline
# bench` in NVIDIA's container measures the real table, which --cost-model reads).
PROFILES = {"h100-70b": dict(target="llama-70b", draft="eagle3", gpu="h100-80gb", qformat="fp8", tflops=1979.0,
                             compute_efficiency=0.25)}
ROWS = (("queue", False), ("queue", True), ("gate", False), ("gate", True))


def profile_replica(name: str, acceptance: float, k: int, startup_s: float):
    from pipeline.deploy.simulate import Replica, crossover, gpu_profile
    from pipeline.models.presets import get_preset
    from pipeline.plan.gpus import get_gpu
    from pipeline.plan.memory import PlanDraft, PlanInputs, plan_memory

    p = PROFILES[name]
    shape, gpu = get_preset(p["target"]).shape, get_gpu(p["gpu"])
    plan = plan_memory(PlanInputs(p["target"], shape, gpu, target_qformat=p["qformat"],
                                  draft=PlanDraft(p["draft"], p["draft"])))
    tp = plan.min_tp or 2
    per_gpu = plan.target_weights[p["qformat"]].per_gpu(tp) + plan.draft_weights.per_gpu(tp)
    cost = gpu_profile(per_gpu, shape.param_count, tp, gpu.bandwidth_tb_s, p["tflops"], max_drafts=k,
                       compute_efficiency=p["compute_efficiency"])
    batch = 128
    return Replica(cost, acceptance, k, crossover(cost, acceptance, k, batch), batch, tp, startup_s), \
        f"{p['target']} {p['qformat']} + {p['draft']} on {tp} x {gpu.name} (roofline)"


def measured_replica(folder: Path, acceptance: float, k: int, gpus: int, startup_s: float):
    from pipeline.deploy.simulate import Replica, crossover
    from pipeline.policy.cost_model import CostModel

    cost = CostModel.load(folder)
    if cost is None:
        sys.exit(f"{folder} has no cost_model.json; run `pipeline bench --engine {folder} --apply` first")
    k = min(k, cost.max_drafts)
    batch = cost.rows[-1]
    return Replica(cost, acceptance, k, crossover(cost, acceptance, k, batch), batch, gpus, startup_s), \
        f"{folder} ({cost.source})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="h100-70b", choices=sorted(PROFILES))
    ap.add_argument("--cost-model", type=Path, help="An engine folder with a measured cost_model.json instead.")
    ap.add_argument("--gpus", type=int, default=1, help="GPUs per replica with --cost-model (0: CPU, no GPU-hours).")
    ap.add_argument("--acceptance", type=float, default=0.75,
                    help="The draft's per-token acceptance (EAGLE-3 on Llama-3: 0.7-0.8).")
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--peak-rps", type=float, default=20.0, help="Requests/s at the daily peak, before bursts.")
    ap.add_argument("--output-tokens", type=int, default=400)
    ap.add_argument("--startup-s", type=float, default=300.0, help="Scheduled to serving, per new pod.")
    ap.add_argument("--max-replicas", type=int, default=32)
    ap.add_argument("--gpu-hour-usd", type=float, default=2.5, help="Price of one GPU-hour (an assumption).")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", type=Path, help="Write a PNG: traffic and pods over the day, per policy.")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from dataclasses import replace

    from pipeline.deploy.simulate import day_of_traffic, simulate

    if args.cost_model is not None:
        replica, what = measured_replica(args.cost_model, args.acceptance, args.num_draft_tokens, args.gpus,
                                         args.startup_s)
    else:
        replica, what = profile_replica(args.profile, args.acceptance, args.num_draft_tokens, args.startup_s)
    traffic = day_of_traffic(args.peak_rps, args.output_tokens, args.seed)
    results = []
    for policy, speculate in ROWS:
        r = replica if speculate else replace(replica, acceptance=0.0)
        res = simulate(r, traffic, policy, max_replicas=args.max_replicas, gpu_hour_usd=args.gpu_hour_usd)
        results.append((policy, speculate, res))

    header = (f"{what}; gate ceiling {replica.gate} (the crossover), {replica.gpus} GPU(s) per replica, "
              f"{int(traffic.arrivals.sum())} requests x {traffic.output_tokens} tokens, peak {args.peak_rps:g} "
              f"req/s + bursts, ${args.gpu_hour_usd:g}/GPU-hour")
    rows = [{"policy": p, "speculation": s, "tokens_per_s": round(r.tokens_per_s), "itl_p50_ms": round(r.itl_p50_ms, 1),
             "itl_p99_ms": round(r.itl_p99_ms, 1), "queue_p99_s": round(r.queue_p99_s, 1),
             "mean_replicas": round(r.mean_replicas, 2), "gpu_hours": round(r.gpu_hours, 1),
             "usd_per_m_tokens": round(r.cost_per_m_tokens, 3), "speculated_share": round(r.speculated_share, 2)}
            for p, s, r in results]
    if args.plot:
        plot(traffic, results, args.plot, what)
    if args.json:
        print(json.dumps({"setup": header, "rows": rows, "plot": str(args.plot) if args.plot else None}, indent=2))
        return
    print(header)
    print("| policy | speculation | tok/s | ITL p50 / p99 ms | queue p99 s | mean pods | GPU-hours | $ per 1M tokens |"
          " tokens speculated |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['policy']} | {'on' if row['speculation'] else 'off'} | {row['tokens_per_s']} | "
              f"{row['itl_p50_ms']} / {row['itl_p99_ms']} | {row['queue_p99_s']} | {row['mean_replicas']} | "
              f"{row['gpu_hours']} | {row['usd_per_m_tokens']} | {row['speculated_share']:.0%} |")


def plot(traffic, results, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    hours = np.arange(len(traffic.arrivals)) / 3600
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    per_min = traffic.arrivals.reshape(-1, 60).sum(axis=1)
    top.plot(np.arange(len(per_min)) / 60, per_min, color="gray", linewidth=0.7)
    top.set_ylabel("requests / min")
    top.set_title(title, fontsize=9)
    for policy, speculate, r in results:
        bottom.plot(hours, r.replicas, linewidth=0.9,
                    label=f"{policy}, speculation {'on' if speculate else 'off'}: ${r.cost_per_m_tokens:.3f}/1M tokens")
    bottom.set_ylabel("pods")
    bottom.set_xlabel("hour of the day")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
