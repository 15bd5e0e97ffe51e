"""The Grafana dashboard for a served repository: latency, throughput, speculation and the gate, the engine's
KV cache and queue. Pure: `dashboard()` is the JSON model Grafana imports (Dashboards > New > Import), and
`pipeline deploy kubernetes` ships it as a ConfigMap that kube-prometheus-stack's Grafana sidecar loads.

Every query names metrics the server exports (speculation_gate's and torch_engine's pipeline_* families,
Triton's nv_* ones); a test scrapes a real tritonserver and checks each name (METRICS).
"""

from __future__ import annotations

import re

UID = "specdec-pipeline"
# kube-prometheus-stack's Grafana sidecar loads ConfigMaps carrying this label (its grafana.sidecar.dashboards
# defaults: label grafana_dashboard, value "1").
SIDECAR_LABEL = ("grafana_dashboard", "1")
QUANTILES = (0.5, 0.9, 0.99)
WINDOW = "$__rate_interval"  # Grafana's own choice of a rate window for the scrape interval


def _quantiles(metric: str) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket[{WINDOW}])))", f"p{round(q * 100)}")
            for q in QUANTILES]


# (title, unit, [(PromQL, legend)]): one time-series panel each, two to a row.
PANELS: tuple[tuple[str, str, list[tuple[str, str]]], ...] = (
    ("Requests by decoding mode", "reqps",
     [(f"sum by (mode) (rate(pipeline_requests_total[{WINDOW}]))", "{{mode}}")]),
    ("Tokens per second", "short",
     [(f"sum(rate(pipeline_prompt_tokens_total[{WINDOW}]))", "prompt"),
      (f"sum(rate(pipeline_generation_tokens_total[{WINDOW}]))", "generated")]),
    ("Time to first token (streamed requests)", "s", _quantiles("pipeline_time_to_first_token_seconds")),
    ("Inter-token latency (streamed requests)", "s", _quantiles("pipeline_inter_token_latency_seconds")),
    ("End-to-end request latency", "s", _quantiles("pipeline_e2e_request_latency_seconds")),
    ("Draft acceptance", "short",
     [("avg(pipeline_spec_decode_acceptance_rate)", "acceptance rate"),
      ("avg(pipeline_spec_decode_mean_acceptance_length)", "tokens per verify step")]),
    ("Load gate", "short",
     [("sum(pipeline_gate_in_flight)", "in flight"), ("max(pipeline_gate_threshold)", "threshold"),
      ("min(pipeline_gate_speculating)", "speculating (1/0)")]),
    ("Decode steps that drafted nothing, by reason", "short",
     [(f"sum by (reason) (rate(pipeline_spec_decode_skipped_steps_total[{WINDOW}]))", "{{reason}}")]),
    ("KV-cache usage", "percentunit", [("max(pipeline_engine_kv_cache_usage_ratio)", "used")]),
    ("Prefix-cache hit rate (prompt tokens)", "percentunit",
     [(f"sum(rate(pipeline_engine_prefix_cache_hits_total[{WINDOW}])) / "
       f"sum(rate(pipeline_engine_prefix_cache_queries_total[{WINDOW}]))", "cached")]),
    ("Engine queue", "short",
     [("sum(pipeline_engine_requests_running)", "running"), ("sum(pipeline_engine_requests_waiting)", "waiting"),
      ("sum(nv_inference_pending_request_count)", "Triton pending")]),
    ("Refused and failed", "reqps",
     [(f"sum(rate(pipeline_gate_rejected_total[{WINDOW}]))", "refused as busy"),
      (f"sum by (reason) (rate(pipeline_engine_requests_finished_total[{WINDOW}]))", "finished: {{reason}}")]),
    ("Triton request outcomes", "reqps",
     [(f"sum(rate(nv_inference_request_success[{WINDOW}]))", "success"),
      (f"sum(rate(nv_inference_request_failure[{WINDOW}]))", "failure")]),
)


def metric_names() -> set[str]:
    """Every metric the queries read, as the server exports it (a histogram's _bucket series included)."""
    names = set()
    for _, _, targets in PANELS:
        for expr, _ in targets:
            names.update(re.findall(r"\b((?:pipeline|nv)_\w+)", expr))
    return names


def dashboard() -> dict:
    panels = []
    for i, (title, unit, targets) in enumerate(PANELS):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": title,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend,
                         "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                        for j, (expr, legend) in enumerate(targets)],
        })
    return {
        "uid": UID, "title": "Speculative decoding pipeline", "tags": ["specdec-pipeline", "triton"],
        "timezone": "browser", "schemaVersion": 39, "version": 1, "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus",
                                 "label": "Prometheus"}]},
        "panels": panels,
    }
