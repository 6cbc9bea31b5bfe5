"""The chart's Grafana dashboard (grafanaDashboard.enabled): a ConfigMap the kube-prometheus-stack
sidecar loads, whose every query (panels and template variables) names only metrics that a live
`quire serve` (tiny random Llama, LoRA on) and `quire router` export."""

from __future__ import annotations

import json
import re

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from chart_render import by_kind, lint, render
from router_harness import quire_serve, router, server_harness

ON = {"grafanaDashboard": {"enabled": True}}
# What Prometheus stores besides a family's own name: a histogram's series, a counter's _total.
SERIES_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",),
                   "gauge": ("",), "unknown": ("",), "info": ("_info",), "summary": ("_sum", "_count", "")}
# PromQL's words that are not metric names (functions are told apart by the "(" after them).
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
                "and", "or", "unless", "inf", "nan", "atan2"}
IDENTIFIER = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
# Grafana's template query: label_values(SELECTOR, LABEL); only SELECTOR is PromQL.
LABEL_VALUES = re.compile(r"^\s*label_values\((?P<expr>.*),\s*[a-zA-Z_][a-zA-Z0-9_]*\s*\)\s*$", re.S)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers that are not functions (followed
    by "("), keywords, label names (inside {...} or a by/without/on/ignoring/group_* list),
    durations, strings or Grafana variables."""
    m = LABEL_VALUES.match(expr)
    if m:
        expr = m.group("expr")
    expr = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)  # strings
    expr = re.sub(r"\{[^}]*\}", " ", expr)                                 # label matchers
    expr = re.sub(r"\[[^\]]*\]", " ", expr)                                # ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\$\{?\w+\}?", " ", expr)                              # $variables
    names = set()
    for token in IDENTIFIER.finditer(expr):
        followed_by = expr[token.end():].lstrip()[:1]
        word = token.group()
        if followed_by == "(" or word.lower() in PROMQL_WORDS:
            continue
        if token.start() > 0 and (expr[token.start() - 1].isdigit() or expr[token.start() - 1] == "."):
            continue  # the exponent or unit of a number, e.g. 1e3
        names.add(word)
    return names


def test_the_tokenizer_finds_metrics_and_nothing_else():
    expr = ('histogram_quantile(0.99, sum by (le) (rate(quire:ttft_bucket{pod=~"$pod", a="x{y}"}'
            '[$__rate_interval]))) / on (pod) group_left (model_name) up or vector(1e3) '
            '+ sum without (instance) (quire:b) offset 5m')
    assert metric_names(expr) == {"quire:ttft_bucket", "up", "quire:b"}
    assert metric_names('label_values(quire:x{namespace=~"$namespace"}, pod)') == {"quire:x"}


def dashboard(values=ON) -> tuple[dict, dict]:
    (config_map,) = [cm for cm in by_kind(render(values), "ConfigMap")
                     if cm["metadata"]["name"].endswith("-dashboard")]
    (text,) = config_map["data"].values()
    return config_map, json.loads(text)


def queries(board: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query template variable."""
    found = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            found.append((panel["title"], target["expr"]))
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            found.append((f"${var['name']}", query))
    return found


def test_the_config_map_carries_the_sidecars_label_and_only_when_enabled():
    config_map, board = dashboard()
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert board["uid"] and board["title"]
    assert not [cm for cm in by_kind(render(), "ConfigMap") if cm["metadata"]["name"].endswith("-dashboard")]
    values = {"grafanaDashboard": {"enabled": True, "folder": "LLM serving", "namespace": "monitoring",
                                   "labels": {"release": "kps"}, "labelValue": "quire"}}
    config_map, _ = dashboard(values)
    meta = config_map["metadata"]
    assert meta["namespace"] == "monitoring"
    assert meta["labels"]["release"] == "kps" and meta["labels"]["grafana_dashboard"] == "quire"
    assert meta["annotations"] == {"grafana_folder": "LLM serving"}
    assert lint(values)["errors"] == []


def test_the_dashboard_has_the_promised_panels_and_variables():
    _, board = dashboard()
    variables = {v["name"] for v in board["templating"]["list"]}
    assert {"datasource", "namespace", "llmdeployment", "pod"} <= variables
    everything = " ".join(expr for _, expr in queries(board))
    for promised in ("quire:time_to_first_token_seconds_bucket", "quire:inter_token_latency_seconds_bucket",
                     "quire:num_requests_waiting", "quire:kv_cache_usage_perc", "quire:prefix_cache_hits_total",
                     "quire:num_preemptions_total", "quire:prompt_tokens_total", "quire:generation_tokens_total",
                     "quire:lora_requests_running", "quire:structured_output_requests_total",
                     "quire:request_success_total", "quire_router:pending_requests"):
        assert promised in everything, promised
    for where, expr in queries(board):
        if "quire:" in expr and "label_values" not in expr and "quire_router:" not in expr:
            assert 'quire_dev_llmdeployment=~"$llmdeployment"' in expr, where  # per LLMDeployment
    # Every panel on the grid, none overlapping.
    cells = set()
    for panel in board["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, panel["title"]
        cells |= mine


def exported_series(url: str) -> set[str]:
    """The series names a Prometheus scraping `url`/metrics would store."""
    text = requests.get(url + "/metrics", timeout=10).text
    names = set()
    for family in text_string_to_metric_families(text):
        names |= {s.name for s in family.samples}
        # a family with no sample yet (a LoRA gauge before any adapter) still names its series
        names |= {family.name + suffix for suffix in SERIES_SUFFIXES[family.type]}
    return names


@pytest.fixture(scope="module")
def live_series():
    tiny = server_harness().tiny_model()
    serve = quire_serve("dashboard", "127.0.0.61", tiny, "--dtype", "float32", "--kv-cache-memory", "16M",
                        "--num-threads", "1", "--enable-lora")
    try:
        serve.start(300)
        with router(f"--backend={serve.url}", host="127.0.0.62") as r:
            r_done = requests.post(r.url + "/v1/completions", timeout=120,
                                   json={"prompt": [1, 2, 3], "max_tokens": 2})
            assert r_done.status_code == 200
            yield exported_series(serve.url) | exported_series(r.url)
    finally:
        serve.stop()


def test_every_query_reads_only_metrics_that_are_exported(live_series):
    _, board = dashboard()
    read = {}
    for where, expr in queries(board):
        for name in metric_names(expr):
            read.setdefault(name, where)
    assert len(read) >= 15
    missing = {name: where for name, where in read.items() if name not in live_series}
    assert missing == {}, f"not exported by quire serve / quire router: {missing}"
