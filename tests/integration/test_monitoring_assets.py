"""The monitoring assets in monitoring/ (alerts, their unit tests, Prometheus configs, the Grafana dashboard) and
their runbook docs/alerts.md, checked with promtool (Debian's prometheus package).

The alert unit tests are themselves tested: each rule in turn is replaced by one that never fires and by one that
fires whenever the rule does not, and `promtool test rules` must then fail. Dashboard queries are checked as
PromQL and evaluated by promtool against the series of a small cluster, where each must return data.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tfelastic.daemon.metrics.gpu import THROTTLE_REASONS
from tfelastic.daemon.rendezvous.api import FailureCause, GoodputView, JobState, NodeState, RestartReason
from tfelastic.daemon.rendezvous.goodput import CATEGORIES
from tfelastic.daemon.rendezvous.quarantine import QUARANTINE_KINDS
from tfelastic.daemon.worker.states import WorkerState
from tfelastic.trainer.progress import RESTORE_TIERS

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("promtool") is None,
                       reason="promtool (Debian's prometheus package) is not installed; tests/run.sh installs it"),
]

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "monitoring"
ALERTS = MONITORING / "alerts.yml"
ALERTS_TEST = MONITORING / "alerts_test.yml"
DASHBOARD = MONITORING / "grafana-dashboard.json"
RUNBOOK = ROOT / "docs" / "alerts.md"
CONFIGS = ("prometheus-static.yml", "prometheus-file-sd.yml")
TOKEN_FILE = "tfelastic-metrics-token"  # what both configs name in authorization.credentials_file

_HISTOGRAMS = ("tfelastic_rendezvous_duration_seconds", "tfelastic_failure_detection_seconds",
               "tfelastic_recovery_seconds", "tfelastic_checkpoint_save_stall_seconds",
               "tfelastic_restore_steps_redone", "tfelastic_gpu_release_wait_seconds")
# Every metric the daemon exports (daemon/metrics/), histograms by their series; `up` is Prometheus's own.
KNOWN_METRICS = frozenset({
    # agent
    "tfelastic_agent_info", "tfelastic_training_step", "tfelastic_training_steps_total",
    "tfelastic_training_examples_total", "tfelastic_training_loss",
    "tfelastic_training_last_progress_timestamp_seconds", "tfelastic_checkpoint_step",
    "tfelastic_checkpoint_timestamp_seconds", "tfelastic_generation", "tfelastic_world_size", "tfelastic_rank",
    "tfelastic_worker_state", "tfelastic_restarts_total", "tfelastic_worker_graceful_stops_total",
    "tfelastic_trainer_failures_total", "tfelastic_stall_limit_seconds", "tfelastic_worker_launches_total",
    "tfelastic_standby_memory_bytes", "tfelastic_standby_ready", "tfelastic_checkpoint_restores_total",
    *(f"{h}_{suffix}" for h in _HISTOGRAMS for suffix in ("bucket", "sum", "count")),
    "tfelastic_worker_processes", "tfelastic_worker_cpu_seconds_total", "tfelastic_worker_resident_memory_bytes",
    "tfelastic_worker_open_fds", "tfelastic_host_memory_total_bytes", "tfelastic_host_memory_available_bytes",
    "tfelastic_backup_dir_free_bytes", "tfelastic_build_info",
    # coordinator
    "tfelastic_cluster_info", "tfelastic_cluster_generation", "tfelastic_cluster_members",
    "tfelastic_cluster_desired_nodes", "tfelastic_cluster_nodes", "tfelastic_cluster_job_state",
    "tfelastic_cluster_restarts_total", "tfelastic_cluster_max_restarts", "tfelastic_cluster_node_quarantined",
    "tfelastic_cluster_quarantines_total", "tfelastic_cluster_steps_redone_total", "tfelastic_cluster_steps_lost_total",
    "tfelastic_job_seconds_total", "tfelastic_cluster_vacant_tasks",
    # etcd (daemon/etcd/metrics.py)
    "tfelastic_coordinator_leader_changes_total", "tfelastic_coordinator_elections_won_total",
    "tfelastic_coordinator_leading", "tfelastic_etcd_request_errors_total",
    *(f"tfelastic_etcd_request_duration_seconds_{suffix}" for suffix in ("bucket", "sum", "count")),
    # GPUs
    "tfelastic_gpu_utilization_ratio", "tfelastic_gpu_memory_utilization_ratio", "tfelastic_gpu_memory_used_bytes",
    "tfelastic_gpu_memory_total_bytes", "tfelastic_gpu_temperature_celsius", "tfelastic_gpu_power_watts",
    "tfelastic_gpu_sm_clock_hertz", "tfelastic_gpu_ecc_errors_total", "tfelastic_gpu_xid_errors_total",
    "tfelastic_gpu_last_xid", "tfelastic_gpu_throttle_reason", "tfelastic_gpu_info", "tfelastic_gpu_nvml_up",
    "tfelastic_gpus",
})
KNOWN_LABELS = frozenset({"tfelastic_job"})  # the one label name the regex below also finds
METRIC_NAME = re.compile(r"tfelastic_[a-z_]+")

# The labels of each metric besides the target's own (instance, job), and the values of the enumerated ones.
_GPU = ("gpu", "uuid", "name")
METRIC_LABELS: dict[str, tuple[str, ...]] = {
    "tfelastic_agent_info": ("tfelastic_job", "node"), "tfelastic_cluster_info": ("tfelastic_job",),
    "tfelastic_worker_state": ("state",), "tfelastic_restarts_total": ("reason",),
    "tfelastic_cluster_desired_nodes": ("bound",), "tfelastic_cluster_nodes": ("state",),
    "tfelastic_cluster_job_state": ("state",), "tfelastic_cluster_restarts_total": ("reason",),
    "tfelastic_cluster_node_quarantined": ("node", "kind"), "tfelastic_cluster_quarantines_total": ("kind",),
    **{f"{h}_bucket": ("le",) for h in _HISTOGRAMS},
    **{m: _GPU for m in KNOWN_METRICS if m.startswith("tfelastic_gpu_") and m != "tfelastic_gpu_nvml_up"},
    "tfelastic_gpu_ecc_errors_total": (*_GPU, "type"), "tfelastic_gpu_throttle_reason": (*_GPU, "reason"),
    "tfelastic_gpu_info": (*_GPU, "driver_version"),
    "tfelastic_worker_graceful_stops_total": ("outcome",), "tfelastic_worker_launches_total": ("start",),
    "tfelastic_trainer_failures_total": ("cause",), "tfelastic_checkpoint_restores_total": ("tier",),
    "tfelastic_etcd_request_errors_total": ("method", "code"),
    "tfelastic_etcd_request_duration_seconds_bucket": ("method", "le"),
    "tfelastic_etcd_request_duration_seconds_sum": ("method",),
    "tfelastic_etcd_request_duration_seconds_count": ("method",),
    "tfelastic_build_info": ("version", "protocol", "python", "role"), "tfelastic_job_seconds_total": ("category",),
}
LABEL_VALUES: dict[tuple[str, str], frozenset[str]] = {
    ("tfelastic_worker_state", "state"): frozenset(s.value for s in WorkerState),
    ("tfelastic_cluster_job_state", "state"): frozenset(s.value for s in JobState),
    ("tfelastic_cluster_nodes", "state"): frozenset(s.value for s in NodeState),
    ("tfelastic_restarts_total", "reason"): frozenset(r.value for r in RestartReason),
    ("tfelastic_cluster_restarts_total", "reason"): frozenset(r.value for r in RestartReason),
    ("tfelastic_cluster_desired_nodes", "bound"): frozenset({"min", "max"}),
    ("tfelastic_cluster_node_quarantined", "kind"): frozenset(QUARANTINE_KINDS),
    ("tfelastic_cluster_quarantines_total", "kind"): frozenset(QUARANTINE_KINDS),
    ("tfelastic_gpu_ecc_errors_total", "type"): frozenset({"corrected", "uncorrected"}),
    ("tfelastic_gpu_throttle_reason", "reason"): frozenset(reason for reason, _ in THROTTLE_REASONS),
    ("tfelastic_worker_graceful_stops_total", "outcome"): frozenset({"checkpointed", "exited", "killed"}),
    ("tfelastic_worker_launches_total", "start"): frozenset({"warm", "cold"}),
    ("tfelastic_trainer_failures_total", "cause"): frozenset(c.value for c in FailureCause),
    ("tfelastic_checkpoint_restores_total", "tier"): frozenset(RESTORE_TIERS),
    ("tfelastic_job_seconds_total", "category"): frozenset(CATEGORIES),
    ("tfelastic_build_info", "role"): frozenset({"agent", "coordinator"}),
}
SELECTOR = re.compile(r"(tfelastic_[a-z_]+)\{([^}]*)\}")
MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def output(result: subprocess.CompletedProcess[str]) -> str:
    return result.stdout + result.stderr


# ------------------------------------------------------------------------------------------------ alert rules

@dataclass(frozen=True)
class Rule:
    """One alerting rule of alerts.yml, read line by line (no YAML parser in the dev dependencies)."""

    name: str
    start: int  # index of its `- alert:` line
    end: int  # index after its last line
    lines: tuple[str, ...]

    def field(self, key: str) -> str | None:
        pattern = re.compile(rf"^\s+{re.escape(key)}: (.+)$")
        found = [m.group(1) for line in self.lines if (m := pattern.match(line))]
        assert len(found) <= 1, f"{self.name}: {key} appears {len(found)} times"
        return found[0].strip() if found else None

    def block(self, key: str) -> tuple[int, int, int]:
        """(first line, end, indentation) of a `key: |` or `key: >-` block scalar, relative to the rule."""
        for i, line in enumerate(self.lines):
            m = re.match(rf"^( +){re.escape(key)}: [|>]-?$", line)
            if m:
                indent = len(m.group(1))
                j = i + 1
                while j < len(self.lines) and (not self.lines[j].strip()
                                               or len(self.lines[j]) - len(self.lines[j].lstrip()) > indent):
                    j += 1
                return i, j, indent
        raise AssertionError(f"{self.name}: no `{key}: |` block (alerts.yml writes expr and description as blocks)")

    def block_text(self, key: str) -> str:
        i, j, _ = self.block(key)
        return "\n".join(line.strip() for line in self.lines[i + 1:j]).strip()


def read_rules(text: str) -> list[Rule]:
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if re.match(r"^ +- alert: \w+$", line)]
    assert starts, "no `- alert:` lines in alerts.yml"
    records = [i for i, line in enumerate(lines) if re.match(r"^ +- record:", line)]
    assert all(i < starts[0] for i in records), "recording rules go before the alerts (an alert runs to the next one)"
    rules = []
    for n, start in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(lines)
        while end > start + 1 and (not lines[end - 1].strip() or lines[end - 1].lstrip().startswith("#")):
            end -= 1  # trailing blank lines and the next rule's comments belong to no rule
        rules.append(Rule(lines[start].split(": ", 1)[1].strip(), start, end, tuple(lines[start:end])))
    return rules


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives headings: lower case, punctuation dropped, spaces to dashes."""
    anchors = set()
    for m in re.finditer(r"^#{1,6} +(.+?) *$", markdown, re.M):
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


def test_alert_rules_pass_promtool_check() -> None:
    result = promtool("check", "rules", str(ALERTS))
    assert result.returncode == 0, output(result)
    assert "SUCCESS" in result.stdout and "WARNING" not in output(result), output(result)


def test_alert_unit_tests_pass() -> None:
    result = promtool("test", "rules", str(ALERTS_TEST))
    assert result.returncode == 0 and "SUCCESS" in result.stdout, output(result)


def test_every_alert_has_for_severity_annotations_and_a_runbook_section() -> None:
    rules = read_rules(ALERTS.read_text())
    anchors = github_anchors(RUNBOOK.read_text())
    seen: set[tuple[str, str]] = set()
    for rule in rules:
        assert re.fullmatch(r"Tfelastic[A-Z]\w+", rule.name), rule.name
        duration = rule.field("for")
        assert duration and re.fullmatch(r"\d+[smh]", duration), f"{rule.name}: for: {duration!r}"
        severity = rule.field("severity")
        assert severity in ("critical", "warning"), f"{rule.name}: severity {severity!r}"
        assert (rule.name, severity) not in seen, f"{rule.name} twice with severity {severity}"
        seen.add((rule.name, severity))
        summary = rule.field("summary")
        assert summary and summary.startswith('"') and len(summary) > 10, f"{rule.name}: summary {summary!r}"
        description = rule.block_text("description")
        assert "{{" in description and ("$value" in description or "$labels" in description), \
            f"{rule.name}: the description should show the values: {description!r}"
        assert rule.block_text("expr"), f"{rule.name}: empty expr"
        url = rule.field("runbook_url")
        assert url == f'"docs/alerts.md#{rule.name.lower()}"', f"{rule.name}: runbook_url {url!r}"
        assert rule.name.lower() in anchors, f"docs/alerts.md has no section for {rule.name}"
    documented = {a for a in anchors if a.startswith("tfelastic")}
    assert documented == {r.name.lower() for r in rules}, "docs/alerts.md sections and alerts.yml disagree"


def mutate(text: str, rule: Rule, kind: str) -> str:
    """alerts.yml with one rule's expr replaced: `never` fires never, `inverse` fires exactly when it does not."""
    lines = text.splitlines()
    i, j, indent = rule.block("expr")
    body = [line.strip() for line in rule.lines[i + 1:j] if line.strip()]
    pad = " " * (indent + 2)
    new_body = ["vector(1) == 0"] if kind == "never" else ["(", *body, ") or on () vector(1)"]
    replacement = [f"{' ' * indent}expr: |", *(pad + line for line in new_body)]
    absolute = rule.start + i
    return "\n".join([*lines[:absolute], *replacement, *lines[rule.start + j:]]) + "\n"


def cases_naming(test_text: str, alertname: str) -> str:
    """alerts_test.yml with only the test groups that assert on ``alertname``. promtool compares each assertion's
    alerts of its own alertname alone, and no rule reads another's alerts, so a mutant of that rule fails these
    groups exactly when it fails the whole file; the others cost seconds per mutant and cannot notice it."""
    lines = test_text.splitlines()
    tests_at = lines.index("tests:")
    starts = [i for i in range(tests_at + 1, len(lines)) if lines[i].startswith("  - ")]
    groups = [lines[a:b] for a, b in zip(starts, [*starts[1:], len(lines)], strict=True)]
    kept = [g for g in groups if any(line.strip() == f"alertname: {alertname}" for line in g)]
    assert kept, f"alerts_test.yml has no case for {alertname}"
    return "\n".join([*lines[:tests_at + 1], *(line for g in kept for line in g)]) + "\n"


def surviving_mutants(kind: str, tmp_path: Path) -> list[str]:
    """The rules whose mutant `promtool test rules` does not notice."""
    text = ALERTS.read_text()
    rules = read_rules(text)
    test_text = ALERTS_TEST.read_text()
    assert "ALERTS" not in text, "a rule reads alerts: a mutant must then be tested against every case"

    def run(n: int) -> str | None:
        rule = rules[n]
        folder = tmp_path / f"{kind}-{n}"
        folder.mkdir()
        (folder / "alerts.yml").write_text(mutate(text, rule, kind))
        (folder / "alerts_test.yml").write_text(cases_naming(test_text, rule.name))
        check = promtool("check", "rules", "alerts.yml", cwd=folder)
        assert check.returncode == 0, f"the {kind} mutant of {rule.name} is no valid rule file: {output(check)}"
        result = promtool("test", "rules", "alerts_test.yml", cwd=folder)
        if result.returncode == 0:
            return f"{rule.name} ({rule.field('severity')})"
        assert "FAILED" in output(result), output(result)
        return None

    with ThreadPoolExecutor(max_workers=4) as pool:
        return [name for name in pool.map(run, range(len(rules))) if name is not None]


def test_alert_unit_tests_fail_when_a_rule_never_fires(tmp_path: Path) -> None:
    survivors = surviving_mutants("never", tmp_path)
    assert not survivors, f"no test case expects these alerts to fire: {survivors}"


def test_alert_unit_tests_fail_when_a_rule_fires_where_it_should_not(tmp_path: Path) -> None:
    survivors = surviving_mutants("inverse", tmp_path)
    assert not survivors, f"no test case expects these alerts to stay quiet (after their for:): {survivors}"


# ----------------------------------------------------------------------------------------- Prometheus configs

def install(config: str, tmp_path: Path, token: bool = True) -> Path:
    """The config as an operator installs it: alerts.yml, targets/ and the token file next to it."""
    shutil.copy(MONITORING / config, tmp_path / config)
    shutil.copy(ALERTS, tmp_path / "alerts.yml")
    shutil.copytree(MONITORING / "targets", tmp_path / "targets")
    if token:
        token_path = tmp_path / TOKEN_FILE
        token_path.write_text("0123456789abcdef0123456789abcdef\n")
        token_path.chmod(0o600)
    return tmp_path / config


@pytest.mark.parametrize("config", CONFIGS)
def test_prometheus_config_passes_promtool_check(config: str, tmp_path: Path) -> None:
    text = (MONITORING / config).read_text()
    assert re.search(r"^  scrape_interval: 15s$", text, re.M), "scrape every 15 s"
    assert re.search(r"^rule_files:\n  - alerts\.yml$", text, re.M)
    for job in ("tfelastic-agents", "tfelastic-coordinator"):
        assert re.search(rf"^  - job_name: {job}\n    authorization:\n      type: Bearer\n"
                         rf"      credentials_file: {TOKEN_FILE}$", text, re.M), f"{job}: bearer token"
    result = promtool("check", "config", str(install(config, tmp_path)))
    assert result.returncode == 0, output(result)
    assert "WARNING" not in output(result), output(result)  # e.g. a missing file_sd target file
    assert "SUCCESS: 1 rule files found" in output(result), output(result)


@pytest.mark.parametrize("config", CONFIGS)
def test_promtool_refuses_the_config_without_its_token_file(config: str, tmp_path: Path) -> None:
    result = promtool("check", "config", str(install(config, tmp_path, token=False)))
    assert result.returncode != 0 and TOKEN_FILE in output(result), output(result)


def test_file_sd_targets_are_agents_on_the_default_port() -> None:
    for name in ("tfelastic-agents.json", "tfelastic-coordinator.json"):
        groups = json.loads((MONITORING / "targets" / name).read_text())
        assert isinstance(groups, list) and groups
        for group in groups:
            assert group["targets"] and all(re.fullmatch(r"[\w.-]+:9464", t) for t in group["targets"]), group
    assert "targets/tfelastic-agents.json" in (MONITORING / "prometheus-file-sd.yml").read_text()


# -------------------------------------------------------------------------------------------------- dashboard

def load_dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))  # the panels of collapsed rows


def data_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in all_panels(dashboard["panels"]) if p.get("type") != "row"]


def substitute(expr: str) -> str:
    """A dashboard query as Grafana would send it: intervals become durations, variables match everything."""
    for name, value in (("__rate_interval", "1m"), ("__interval", "1m"), ("__range", "1h")):
        expr = re.sub(rf"\$\{{{name}\}}|\${name}\b|\[\[{name}\]\]", value, expr)
    expr = re.sub(r"\$\{\w+(:\w+)?\}|\$\w+|\[\[\w+\]\]", ".*", expr)
    assert "$" not in expr, expr
    return expr


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable (as `count by (label) (selector)`)."""
    queries = [(f"panel {p['id']} {p['title']!r} {t['refId']}", substitute(t["expr"]))
               for p in data_panels(dashboard) for t in p["targets"]]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"label_values\((.+), *(\w+)\)", query)
            assert m, f"variable {var['name']}: {query!r}"
            queries.append((f"variable {var['name']}", f"count by ({m.group(2)}) ({substitute(m.group(1))})"))
    return queries


def test_dashboard_panels_have_titles_targets_and_the_datasource_variable() -> None:
    dashboard = load_dashboard()
    assert 36 <= dashboard["schemaVersion"] <= 39
    assert dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert variables["job"]["query"] == "label_values(tfelastic_cluster_info, tfelastic_job)"
    assert variables["node"]["query"] == 'label_values(tfelastic_agent_info{tfelastic_job=~"$job"}, node)'
    assert variables["node"]["includeAll"] and variables["node"]["allValue"] == ".*"
    datasource = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    ids = [p["id"] for p in all_panels(dashboard["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    rows = [p for p in all_panels(dashboard["panels"]) if p.get("type") == "row"]
    assert {r["title"] for r in rows} >= {"Job overview", "Training", "Restarts and recovery", "Nodes", "GPUs"}
    panels = data_panels(dashboard)
    assert len(panels) >= 30
    for panel in panels:
        where = f"panel {panel.get('id')} {panel.get('title')!r}"
        assert panel.get("title"), f"{where}: no title"
        assert panel.get("targets"), f"{where}: no targets"
        assert panel["datasource"] == datasource, where
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0, f"{where}: {grid}"
        for target in panel["targets"]:
            assert target["datasource"] == datasource, where
            assert target.get("expr", "").strip(), f"{where}: empty expr"
            for m in re.finditer(r"\b(rate|irate)\(.*?\[([^\]]+)\]", target["expr"]):
                assert m.group(2) == "$__rate_interval", f"{where}: {m.group(0)} should use $__rate_interval"
            if "tfelastic_agent_info" in target["expr"] or "tfelastic_cluster_info" in target["expr"]:
                assert '=~"$job"' in target["expr"], f"{where}: not filtered by the job variable"


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    queries = dashboard_queries(load_dashboard())
    rules = ["groups:", "  - name: dashboard", "    rules:"]
    for n, (_, expr) in enumerate(queries):
        rules += [f"      - record: dashboard:panel_{n}", f"        expr: {json.dumps(expr)}"]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text("\n".join(rules) + "\n")
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, output(result) + "\n" + "\n".join(f"{n}: {w}" for n, (w, _) in enumerate(queries))
    assert f"SUCCESS: {len(queries)} rules found" in result.stdout, output(result)


def cluster_series() -> list[tuple[str, str]]:
    """One hour, every 15 s, of a 2-node job (mnist) whose coordinator is hosted by the agent on gpu-01,
    which is therefore scraped under both job names; each node has 2 GPUs; counters grow at every scrape."""
    steps = 240
    series: list[tuple[str, str]] = []

    def add(name: str, labels: dict[str, str], values: str) -> None:
        text = ", ".join(f'{k}="{v}"' for k, v in labels.items())
        series.append((f"{name}{{{text}}}", values))

    def const(value: float) -> str:
        return f"{value:g}x{steps}"

    def grows(by: float) -> str:
        return f"0+{by:g}x{steps}"

    targets = [("gpu-01", "tfelastic-agents"), ("gpu-01", "tfelastic-coordinator"), ("gpu-02", "tfelastic-agents")]
    for node, job in targets:
        base = {"instance": f"{node}:9464", "job": job}
        leads = 1 if node == "gpu-01" else 0  # the agent that hosts the coordinator won its election
        add("up", base, const(1))
        add("tfelastic_agent_info", {**base, "tfelastic_job": "mnist", "node": node}, const(1))
        for name, values in (
                ("tfelastic_training_step", grows(10)), ("tfelastic_training_steps_total", grows(10)),
                ("tfelastic_training_examples_total", grows(640)), ("tfelastic_training_loss", "2-0.005x240"),
                ("tfelastic_training_last_progress_timestamp_seconds", "1+15x240"),
                ("tfelastic_checkpoint_step", grows(100)), ("tfelastic_checkpoint_timestamp_seconds", "1+15x240"),
                ("tfelastic_generation", const(3)), ("tfelastic_world_size", const(2)),
                ("tfelastic_rank", const(0 if node == "gpu-01" else 1)), ("tfelastic_worker_processes", const(2)),
                ("tfelastic_worker_cpu_seconds_total", grows(15)),
                ("tfelastic_worker_resident_memory_bytes", const(4e9)), ("tfelastic_worker_open_fds", const(120)),
                ("tfelastic_host_memory_total_bytes", const(5e11)),
                ("tfelastic_host_memory_available_bytes", const(3e11)),
                ("tfelastic_backup_dir_free_bytes", const(2e12)),
                ("tfelastic_gpu_nvml_up", const(1)), ("tfelastic_gpus", const(2)),
                ("tfelastic_stall_limit_seconds", const(20)), ("tfelastic_standby_memory_bytes", const(5e8)),
                ("tfelastic_standby_ready", const(1)), ("tfelastic_coordinator_leading", const(leads)),
                ("tfelastic_coordinator_elections_won_total", const(leads))):
            add(name, base, values)
        add("tfelastic_worker_launches_total", {**base, "start": "cold"}, grows(1))
        add("tfelastic_worker_launches_total", {**base, "start": "warm"}, grows(2))
        add("tfelastic_worker_graceful_stops_total", {**base, "outcome": "checkpointed"}, grows(1))
        add("tfelastic_checkpoint_restores_total", {**base, "tier": "local"}, grows(1))
        add("tfelastic_etcd_request_errors_total", {**base, "method": "Range", "code": "UNAVAILABLE"}, grows(1))
        for i, le in enumerate(("0.001", "0.01", "0.1", "1.0", "+Inf")):
            add("tfelastic_etcd_request_duration_seconds_bucket", {**base, "method": "Range", "le": le}, grows(i + 1))
        add("tfelastic_etcd_request_duration_seconds_count", {**base, "method": "Range"}, grows(5))
        add("tfelastic_etcd_request_duration_seconds_sum", {**base, "method": "Range"}, grows(0.1))
        for state in ("init", "waiting", "running", "succeeded", "failed", "stopping", "stopped"):
            add("tfelastic_worker_state", {**base, "state": state}, const(1 if state == "running" else 0))
        add("tfelastic_restarts_total", {**base, "reason": "worker_exit"}, grows(1))
        add("tfelastic_trainer_failures_total", {**base, "cause": "peer_failure"}, grows(1))
        for histogram in _HISTOGRAMS:
            buckets = ("0.05", "0.1", "0.25", "0.5", "1.0", "2.5", "5.0", "10.0", "30.0", "60.0", "120.0", "300.0")
            for i, le in enumerate(buckets):
                add(f"{histogram}_bucket", {**base, "le": le}, grows(i))
            add(f"{histogram}_bucket", {**base, "le": "+Inf"}, grows(12))
            add(f"{histogram}_count", base, grows(12))
            add(f"{histogram}_sum", base, grows(40))
        for gpu in ("0", "1"):
            labels = {**base, "gpu": gpu, "uuid": f"GPU-{node}-{gpu}", "name": "NVIDIA H100 80GB HBM3"}
            for name, values in (
                    ("tfelastic_gpu_utilization_ratio", const(0.93)),
                    ("tfelastic_gpu_memory_utilization_ratio", const(0.41)),
                    ("tfelastic_gpu_memory_used_bytes", const(6e10)), ("tfelastic_gpu_memory_total_bytes", const(8e10)),
                    ("tfelastic_gpu_temperature_celsius", const(71)), ("tfelastic_gpu_power_watts", const(610)),
                    ("tfelastic_gpu_sm_clock_hertz", const(1.98e9)), ("tfelastic_gpu_xid_errors_total", grows(1)),
                    ("tfelastic_gpu_last_xid", const(13))):
                add(name, labels, values)
            add("tfelastic_gpu_ecc_errors_total", {**labels, "type": "corrected"}, grows(1))
            add("tfelastic_gpu_ecc_errors_total", {**labels, "type": "uncorrected"}, const(0))
            add("tfelastic_gpu_throttle_reason", {**labels, "reason": "sw_power_cap"}, const(1))
            add("tfelastic_gpu_throttle_reason", {**labels, "reason": "hw_slowdown"}, const(0))
            add("tfelastic_gpu_info", {**labels, "driver_version": "550.54.15"}, const(1))
        if node == "gpu-01":  # the hosted coordinator
            add("tfelastic_cluster_info", {**base, "tfelastic_job": "mnist"}, const(1))
            for name, value in (("tfelastic_cluster_generation", 3), ("tfelastic_cluster_members", 2),
                                ("tfelastic_cluster_max_restarts", 3)):
                add(name, base, const(value))
            add("tfelastic_cluster_desired_nodes", {**base, "bound": "min"}, const(2))
            add("tfelastic_cluster_desired_nodes", {**base, "bound": "max"}, const(4))
            for state in ("waiting", "running", "succeeded", "stopping", "leaving"):
                add("tfelastic_cluster_nodes", {**base, "state": state}, const(2 if state == "running" else 0))
            for state in ("waiting", "running", "restarting", "succeeded", "failed"):
                add("tfelastic_cluster_job_state", {**base, "state": state}, const(1 if state == "running" else 0))
            for reason in ("worker_exit", "node_lost", "stalled", "scale_up", "node_left"):
                add("tfelastic_cluster_restarts_total", {**base, "reason": reason}, grows(1))
            for kind in QUARANTINE_KINDS:
                add("tfelastic_cluster_quarantines_total", {**base, "kind": kind}, const(1))
            add("tfelastic_cluster_steps_redone_total", base, grows(5))
            add("tfelastic_cluster_steps_lost_total", base, const(0))
            for category in CATEGORIES:
                add("tfelastic_job_seconds_total", {**base, "category": category}, grows(10 if category == "training"
                                                                                         else 1))
        add("tfelastic_build_info", {**base, "version": "0.2.0", "protocol": "1", "python": "3.11.7",
                                     "role": "agent"}, const(1))
    return series


def test_dashboard_queries_return_data_and_no_errors_for_a_hosted_coordinator(tmp_path: Path) -> None:
    """Every query must evaluate without error (duplicate series in a join fail it) and return something; an
    absent() alert per query turns an empty result into a failed promtool test."""
    queries = dashboard_queries(load_dashboard())
    rules = ["groups:", "  - name: dashboard", "    rules:"]
    for n, (_, expr) in enumerate(queries):
        rules += [f"      - alert: DashboardQuery{n}", f"        expr: {json.dumps(f'absent({expr})')}"]
    (tmp_path / "rules.yml").write_text("\n".join(rules) + "\n")
    tests = ["rule_files: [rules.yml]", "evaluation_interval: 1m", "tests:", "  - interval: 15s",
             "    input_series:"]
    for name, values in cluster_series():
        tests += [f"      - series: {json.dumps(name)}", f"        values: {json.dumps(values)}"]
    tests.append("    alert_rule_test:")
    for n in range(len(queries)):
        tests += ["      - eval_time: 60m", f"        alertname: DashboardQuery{n}", "        exp_alerts: []"]
    (tmp_path / "test.yml").write_text("\n".join(tests) + "\n")
    result = promtool("test", "rules", "test.yml", cwd=tmp_path)
    legend = "\n".join(f"DashboardQuery{n}: {where}: {expr}" for n, (where, expr) in enumerate(queries))
    assert result.returncode == 0, f"{output(result)}\n{legend}"


# ----------------------------------------------------------------------------------------------- metric names

@pytest.mark.parametrize("path", [ALERTS, ALERTS_TEST, DASHBOARD], ids=lambda p: p.name)
def test_only_metrics_the_daemon_exports_are_used(path: Path) -> None:
    used = set(METRIC_NAME.findall(path.read_text()))
    unknown = used - KNOWN_METRICS - KNOWN_LABELS
    assert not unknown, f"{path.name} names metrics the daemon does not export (typos?): {sorted(unknown)}"
    assert used & KNOWN_METRICS, f"{path.name}: no metric found at all"


def selector_problems(text: str) -> list[str]:
    """Label names a metric does not have, and enumerated values it never takes, in `metric{...}` selectors."""
    problems = []
    for selector in SELECTOR.finditer(text):
        metric = selector.group(1)
        for label, op, value in MATCHER.findall(selector.group(2)):
            if label not in ("instance", "job", *METRIC_LABELS.get(metric, ())):
                problems.append(f"{selector.group(0)}: {metric} has no label {label!r}")
            allowed = LABEL_VALUES.get((metric, label))
            values = value.split("|") if op in ("=~", "!~") else [value]
            if allowed is not None and not set(values) <= allowed:
                problems.append(f"{selector.group(0)}: {label} is never {sorted(set(values) - allowed)}")
    return problems


def test_selectors_use_labels_and_values_the_metrics_have() -> None:
    dashboard = load_dashboard()
    texts = {ALERTS.name: ALERTS.read_text(), ALERTS_TEST.name: ALERTS_TEST.read_text(),
             DASHBOARD.name: "\n".join(expr for _, expr in dashboard_queries(dashboard))}
    for name, text in texts.items():
        assert SELECTOR.search(text), f"{name}: no selector found"
        problems = selector_problems(text)
        assert not problems, f"{name}: " + "\n".join(problems)
    assert selector_problems('tfelastic_worker_state{state="runing"} tfelastic_gpus{gpu="0"}') == [
        "tfelastic_worker_state{state=\"runing\"}: state is never ['runing']",
        "tfelastic_gpus{gpu=\"0\"}: tfelastic_gpus has no label 'gpu'"]


def test_the_dashboard_covers_the_job_training_nodes_and_gpus() -> None:
    used = set(METRIC_NAME.findall(DASHBOARD.read_text()))
    expected = {"tfelastic_cluster_job_state", "tfelastic_cluster_generation", "tfelastic_cluster_members",
                "tfelastic_cluster_desired_nodes", "tfelastic_cluster_restarts_total",
                "tfelastic_training_steps_total", "tfelastic_training_loss", "tfelastic_recovery_seconds_bucket",
                "tfelastic_failure_detection_seconds_bucket", "tfelastic_rendezvous_duration_seconds_bucket",
                "tfelastic_training_step", "tfelastic_worker_resident_memory_bytes",
                "tfelastic_worker_cpu_seconds_total", "tfelastic_training_last_progress_timestamp_seconds",
                "tfelastic_checkpoint_timestamp_seconds", "tfelastic_gpu_utilization_ratio",
                "tfelastic_gpu_memory_used_bytes", "tfelastic_gpu_temperature_celsius", "tfelastic_gpu_power_watts",
                "tfelastic_gpu_throttle_reason", "tfelastic_gpu_xid_errors_total"}
    assert not expected - used, f"the dashboard has no panel for {sorted(expected - used)}"


# --------------------------------------------------------------------------------- every metric has a watcher

def exported_metrics(tmp_path: Path) -> set[str]:
    """The sample names of every metric family the daemon registers, read from the real registries: the agent's,
    etcd's, the coordinator's (a snapshot), the host's and the GPUs' (over the fake NVML)."""
    from prometheus_client import CollectorRegistry
    from tfelastic.daemon.etcd.metrics import EtcdMetrics
    from tfelastic.daemon.metrics.agent import AgentMetrics
    from tfelastic.daemon.metrics.build import register_build_info
    from tfelastic.daemon.metrics.cluster import register_cluster_collector
    from tfelastic.daemon.metrics.gpu import register_gpu_collector
    from tfelastic.daemon.metrics.host import register_host_collector
    from tfelastic.daemon.rendezvous.api import ClusterStatus

    from tests.nvml_fake import FakeGpu, FakeNvml

    registry = CollectorRegistry()
    register_build_info(registry, "agent")
    AgentMetrics(registry, "mnist", "gpu-01")
    EtcdMetrics(registry)
    snapshot = ClusterStatus(job="mnist", state=JobState.RUNNING, reason="", generation=1, world_size=0,
                               min_nodes=1, max_nodes=1, max_restarts=3, restarts_total=0, restarts_by_reason={},
                               nodes=(), goodput=GoodputView(dict.fromkeys(CATEGORIES, 1.0)))
    register_cluster_collector(registry, lambda: snapshot)
    register_host_collector(registry, os.getpid, str(tmp_path))
    register_gpu_collector(registry, nvml=FakeNvml([FakeGpu()]), cache_seconds=0)
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "info": ("_info",)}
    return {family.name + suffix for family in registry.collect()
            for suffix in suffixes.get(family.type, ("",))}


def rule_expressions(text: str) -> str:
    """Every `expr: |` block of a rule file, alerts and recording rules, without the comments."""
    lines, blocks = text.splitlines(), []
    for i, line in enumerate(lines):
        m = re.match(r"^( +)expr: \|$", line)
        if m:
            j = i + 1
            while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > len(m.group(1))):
                blocks.append(lines[j])
                j += 1
    return "\n".join(blocks)


def test_known_metrics_are_those_the_daemon_registers(tmp_path: Path) -> None:
    exported = exported_metrics(tmp_path)
    assert exported - KNOWN_METRICS == set(), "KNOWN_METRICS lacks metrics the daemon registers"
    # The GPU collector's metrics that a fake GPU without errors does not produce are the only ones missing.
    assert KNOWN_METRICS - exported <= {"tfelastic_gpu_last_xid", "tfelastic_gpu_xid_errors_total",
                                        "tfelastic_gpu_ecc_errors_total", "tfelastic_gpu_throttle_reason"}, \
        sorted(KNOWN_METRICS - exported)


def test_every_exported_metric_is_on_a_panel_or_in_a_rule(tmp_path: Path) -> None:
    """A metric nobody watches is a promise nobody keeps: each is in a dashboard query or an alerting rule's
    expression (comments and runbooks do not count)."""
    watched = set(METRIC_NAME.findall(rule_expressions(ALERTS.read_text())))
    watched |= set(METRIC_NAME.findall("\n".join(expr for _, expr in dashboard_queries(load_dashboard()))))
    families = {re.sub(r"_(bucket|sum|count)$", "", name) for name in exported_metrics(tmp_path) | KNOWN_METRICS}
    unwatched = sorted(f for f in families if not any(w == f or re.fullmatch(rf"{f}_(bucket|sum|count)", w)
                                                      for w in watched))
    assert not unwatched, f"on no panel and in no rule: {unwatched}"
