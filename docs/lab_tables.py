"""The network lab's figures, read from ``bench/results/``: the what-if validation and the options sweep.

Like :mod:`docs.bench_tables` (whose helpers it uses), one function per table; each returns
Markdown computed from the results file, never measured here.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.netlab_sweep import headline_ms, headline_speedup
from docs.bench_tables import _machine, _mark, load
from docs.markdown import table

__all__ = [
    "buckets",
    "cluster_preemption",
    "headlines",
    "sweep",
    "whatif_by_rate",
    "whatif_route_parts",
    "whatif_sources",
    "whatif_summary",
]

_VALIDATIONS = {
    "loopback_profile": "one 2-rank loopback profile → every rate, bucket size and compression",
    "profile_at_1gbps": "one profile at 1 Gbit/s → bucket sizes and compression there",
    "one_rank_plus_bench_comm": "a 1-rank profile + `bench-comm` over the link → 2 ranks",
    "one_rank_plus_achieved_rate": "a 1-rank profile + the rate a raw TCP transfer achieved (`--link-gbps`) → 2 ranks",
    "one_rank_plus_nominal_rate": "a 1-rank profile + the link's nominal rate (`--link-gbps`) → 2 ranks",
    "one_rank_beside_plus_bench_comm": "a 1-rank profile taken beside a copy (a lab node's compute) + `bench-comm` → 2 ranks",
}


def _errors(rows: list[dict[str, Any]]) -> tuple[float, float]:
    errors = [abs(r["error_pct"]) for r in rows]
    return statistics.median(errors), max(errors)


def whatif_summary(name: str = "whatif") -> str:
    """``bench/whatif.py``: each validation's median and worst error against the targets."""
    r = load(name)
    rows = []
    for name, title in _VALIDATIONS.items():
        found = r["validations"].get(name) or []
        if not found:
            continue
        summary = r["summary"][name]
        worst = max(found, key=lambda row: abs(row["error_pct"]))
        rows.append(
            (
                title,
                str(len(found)),
                f"{summary['median_abs_error_pct']:.1f}%",
                f"{summary['worst_abs_error_pct']:.1f}% ({worst['model']}, {worst['rate_gbps']:g} Gbit/s, "
                f"{worst['config']})",
                _mark(summary["meets_targets"]),
            )
        )
    targets = next(iter(r["summary"].values()))["targets"]
    links = ", ".join(f"{v['configured_gbps']:g} → {v['gbps']:.2f}" for v in r["links"].values())
    note = (
        f"Targets: median |error| ≤ {targets['median_pct']:g}%, worst ≤ {targets['worst_pct']:g}%. "
        f"Link rates configured → achieved (raw TCP, Gbit/s): {links}. {_machine(r)}; "
        f"{r['settings']['rounds']} round(s), each run's median step after {r['settings']['warmup']} warm-up steps."
    )
    header = ("prediction", "runs", "median |error|", "worst |error|", "met")
    return f"{table(header, rows)}\n\n{note}"


_ROUTE = {
    "one_rank_plus_bench_comm": "`bench-comm` over the link",
    "one_rank_plus_achieved_rate": "the rate a raw TCP transfer achieved",
    "one_rank_plus_nominal_rate": "the link's nominal rate",
    "one_rank_beside_plus_bench_comm": "`bench-comm`, the profile taken beside a copy",
}


def _route_cell(rows: list[dict[str, Any]]) -> str:
    """``median / worst (model, config, rate)`` of some predictions' absolute errors; ``–`` for none."""
    if not rows:
        return "–"
    errors = sorted(abs(row["error_pct"]) for row in rows)
    worst = max(rows, key=lambda row: abs(row["error_pct"]))
    middle = statistics.median(errors)
    return f"{middle:.1f}% / {errors[-1]:.1f}% ({worst['model']}, {worst['config']}, {worst['rate_gbps']:g} Gbit/s)"


def whatif_route(name: str = "whatif", split_gbps: float = 2.5) -> str:
    """The documented route (a 1-rank profile + the link) by link input, up to ``split_gbps`` and above it."""
    r = load(name)
    cell = _route_cell
    rates = sorted({row["rate_gbps"] for rows in r["validations"].values() for row in rows})
    low = [rate for rate in rates if rate <= split_gbps]
    high = [rate for rate in rates if rate > split_gbps]
    rows = []
    for key, title in _ROUTE.items():
        found = r["validations"].get(key) or []
        rows.append(
            (
                title,
                cell([row for row in found if row["rate_gbps"] <= split_gbps]),
                cell([row for row in found if row["rate_gbps"] > split_gbps]),
            )
        )
    n_low = sum(1 for row in r["validations"].get("one_rank_plus_bench_comm", []) if row["rate_gbps"] <= split_gbps)
    n_high = sum(1 for row in r["validations"].get("one_rank_plus_bench_comm", []) if row["rate_gbps"] > split_gbps)
    header = (
        "link input",
        f"{'–'.join(f'{x:g}' for x in (low[0], low[-1])) if low else '–'} Gbit/s ({n_low} runs): median / worst",
        f"{', '.join(f'{x:g}' for x in high) or '–'} Gbit/s ({n_high} runs): median / worst",
    )
    configs = ", ".join(dict.fromkeys(row["config"] for row in r["validations"].get("one_rank_plus_bench_comm", [])))
    return f"{table(header, rows)}\n\nA 1-rank profile and the link → 2 ranks, {configs}; `bench/results/{name}.json`."


_PARTS = {
    "the float32 sweep (curve and CPU time)": (False, False),
    "+ the float16 sweep (`--dtype float32,float16`)": (True, False),
    "+ the all-reduce beside compute (`--beside-compute`)": (True, True),
}


def whatif_route_parts(name: str = "whatif") -> str:
    """The documented route re-predicted from the kept results with parts of bench-comm's measurement left out."""
    from bench.whatif import validate

    r = load(name)

    def keep(sweep: dict[str, Any], dtypes: bool, beside: bool) -> dict[str, Any]:
        def rows(found: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return found if beside else [{k: v for k, v in row.items() if not k.startswith("beside")} for row in found]

        others = {d: {**o, "rows": rows(o["rows"])} for d, o in sweep.get("other_dtypes", {}).items()} if dtypes else {}
        return {**sweep, "rows": rows(sweep["rows"]), "other_dtypes": others}

    out = []
    for title, (dtypes, beside) in _PARTS.items():
        sweeps = {rate: keep(sweep, dtypes, beside) for rate, sweep in r["bench_comm"].items()}
        validations = validate(
            r["measurements"], r["inputs"], sweeps, r["compression_costs"], r["settings"]["host_overlap"]
        )
        found = validations["one_rank_plus_bench_comm"]
        low = [row for row in found if row["rate_gbps"] <= 2.5]
        high = [row for row in found if row["rate_gbps"] > 2.5]
        out.append((title, _route_cell(found), _route_cell(low), _route_cell(high)))
    header = ("what the link's measurement holds", "all runs", "0.1–2.5 Gbit/s", "10 Gbit/s")
    return (
        f"{table(header, out)}\n\nThe documented route (a 1-rank profile + `bench-comm` over the link → 2 ranks, "
        f"default and fp16) re-predicted from `bench/results/{name}.json` with parts of each sweep left out: "
        "median / worst |error|."
    )


def whatif_by_rate() -> str:
    """The loopback-profile validation by rate and model: where it misses."""
    r = load("whatif")
    rows_in = r["validations"].get("loopback_profile") or []
    models = list(dict.fromkeys(row["model"] for row in rows_in))
    rates = sorted({row["rate_gbps"] for row in rows_in})
    rows = []
    for rate in rates:
        cells = [f"{rate:g} Gbit/s"]
        for model in models:
            mine = [row for row in rows_in if row["rate_gbps"] == rate and row["model"] == model]
            median, worst = _errors(mine)
            cells.append(f"{median:.1f}% / {worst:.1f}%")
        rows.append(tuple(cells))
    profiles = r["inputs"]
    compute = []
    for model in models:
        loop = profiles["loopback_2"][model]["profile"]["summary"]
        real = profiles["at_1gbps"][model]["profile"]["summary"]
        compute.append(
            (
                model,
                f"{loop['forward_ms']:.1f} / {real['forward_ms']:.1f}",
                f"{loop['backward_compute_ms']:.1f} / {real['backward_compute_ms']:.1f}",
                f"{loop['busbw_gbps']:.2f}",
            )
        )
    by_rate = table(("link", *(f"{m}: median / worst" for m in models)), rows)
    contention = table(
        ("model", "forward ms (loopback / 1 Gbit/s)", "backward ms (same)", "loopback busbw GB/s"), compute
    )
    return f"{by_rate}\n\n{contention}"


def headlines() -> str:
    """The lab's lines for the front page: what compression buys at 1 Gbit/s, what the tuner buys, how well whatif predicts."""
    sweep, r = load("netlab_sweep_1gbps_mlp"), load("whatif")
    by_option = {row["option"]: row for row in sweep["rows"]}
    rate = by_option["ddp"]["measured_gbps"]
    fp16, powersgd = by_option["fp16"], by_option["powersgd1"]
    tuner, fast = load("netlab_buckets_2.5gbps"), load("netlab_buckets_10gbps")
    totals = [m["targets"]["total_vs_default"]["ratio"] for m in tuner["models"]]
    fast_totals = [m["targets"]["total_vs_default"]["ratio"] for m in fast["models"]]
    tuner_rate = statistics.median(tuner["settings"]["link"]["measured_gbps"])
    one_rank = r["summary"]["one_rank_plus_bench_comm"]
    loopback = r["summary"]["loopback_profile"]
    rows = [
        (
            f"8M MLP, 2 nodes over a {rate:.2f} Gbit/s link: step time against Lightning `ddp`",
            f"fp16 {fp16['speedup_vs_ddp']:.2f}×, PowerSGD rank 1 {powersgd['speedup_vs_ddp']:.2f}× "
            f"(loss after 200 steps {fp16['eval_loss']:.4f} / {powersgd['eval_loss']:.4f}, "
            f"`ddp` {by_option['ddp']['eval_loss']:.4f})",
            "[netlab](docs/benchmarks.md#what-each-option-buys-where-communication-costs---sweep)",
        ),
        (
            f'`bucket_cap_mb="auto"`, 2 nodes over a {tuner_rate:.2f} Gbit/s link: 500-step fit, tuning included',
            f"×{min(totals):.2f}–{max(totals):.2f} DDP default's time on {len(totals)} models "
            f"(at 10 Gbit/s: ×{min(fast_totals):.2f}–{max(fast_totals):.2f})",
            "[netlab](docs/benchmarks.md#the-bucket-tuner-where-overlap-matters---buckets)",
        ),
        (
            "`whatif`: 2 ranks predicted from a 1-rank profile + `bench-comm`, 0.1–10 Gbit/s",
            f"median error {one_rank['median_abs_error_pct']:.1f}%, worst {one_rank['worst_abs_error_pct']:.1f}% "
            f"(from a 2-rank loopback profile: worst {loopback['worst_abs_error_pct']:.0f}%)",
            "[whatif](docs/whatif.md#results)",
        ),
    ]
    return f"{table(('over a real link (the network lab)', 'figure', 'details'), rows)}"


def sweep(name: str) -> str:
    """``python -m bench.netlab --sweep`` (results file ``name``): step time per option and rate, beside its loss."""
    r = load(name)
    rows_in = r["rows"]
    rates = sorted({row["rate_gbps"] for row in rows_in})
    achieved = {row["rate_gbps"]: row["measured_gbps"] for row in rows_in}
    rows = []
    for model in dict.fromkeys(row["model"] for row in rows_in):
        for option in dict.fromkeys(row["option"] for row in rows_in if row["model"] == model):
            cells = [model, f"`{option}`"]
            loss = None
            by_rate = {
                rate: next(x for x in rows_in if (x["model"], x["option"], x["rate_gbps"]) == (model, option, rate))
                for rate in rates
            }
            for row in by_rate.values():
                speedup, step = headline_speedup(row), headline_ms(row)
                cells.append("–" if step is None else f"{step:,.1f}" + (f" ({speedup:.2f}×)" if speedup else ""))
                loss = row["eval_loss"] if loss is None else loss
            chosen = ""
            if option == "auto":  # per rate where the table has several: "0.1: 25; 1: 25, 25"
                picked = []
                for rate, row in by_rate.items():
                    picks = [t.get("chosen_mb") for t in (row.get("tuning") or []) if t]
                    listed = ", ".join(f"{c:g}" for c in picks if c is not None)
                    picked.append(listed if len(rates) == 1 else f"{rate:g}: {listed or '–'}")
                chosen = "; ".join(picked)
            cells += ["–" if loss is None else f"{loss:.4f}", chosen]
            rows.append(tuple(cells))
    header = ("model", "option", *(f"{rate:g} Gbit/s (got {achieved[rate]:.2f}): ms (× `ddp`)" for rate in rates))
    header += ("loss after {} steps".format(r["settings"]["loss_steps"]), "`auto` chose (MiB, per round)")
    settings = r["settings"]
    by_rate = settings.get("rounds_by_rate")
    rounds = (
        f"{settings['rounds']} interleaved rounds"
        if not by_rate
        else "interleaved rounds within each run ("
        + ", ".join(f"{n} at {rate} Gbit/s" for rate, n in sorted(by_rate.items(), key=lambda kv: float(kv[0])))
        + "; "
        + " and ".join(", ".join(f"{rate:g}" for rate in added["rates"]) for added in settings.get("added", []))
        + " Gbit/s measured in a later run with `--add-to`, the losses in the first)"
    )
    note = (
        f"{rounds}; each figure the median over rounds of a run's median step after "
        f"{settings['warmup']} warm-up steps ({settings['steps']} steps; `auto`: its mean over {settings['auto_steps']} "
        f"steps, tuning included). {_machine(r)}; {r['wall_s'] / 60:.0f} minutes."
    )
    return f"{table(header, rows)}\n\n{note}"


def _judged(targets: dict[str, Any], key: str) -> str:
    """A target's ratio and mark, or a dash where the run does not judge it."""
    return f"{targets[key]['ratio']:.3f} {_mark(targets[key]['met'])}" if key in targets else "–"


def buckets(rates: tuple[str, ...] = ("10", "2.5")) -> str:
    """``python -m bench.netlab --buckets``: the tuner against DDP's default and the best fixed size, per link."""
    rows = []
    links = []
    for rate in rates:
        r = load(f"netlab_buckets_{rate}gbps")
        link = r["settings"]["link"]
        links.append(f"{link['configured_gbps']:g} → " + " / ".join(f"{g:.2f}" for g in link["measured_gbps"]))
        for m in r["models"]:
            targets = m["targets"]
            rows.append(
                (
                    f"{link['configured_gbps']:g} Gbit/s",
                    m["model"],
                    f"{m['default']['step_ms']:.1f}",
                    f"{m['best']['cap_mb']:g} MiB, {m['best']['step_ms']:.1f} ms",
                    ", ".join(f"{c:g}" for c in m["auto"]["chosen_mb"]),
                    _judged(targets, "tuned_vs_best"),
                    _judged(targets, "total_vs_default_1pct"),
                    _judged(targets, "repeat_consistency"),
                    f"{m['sweep_gap']:+.1%}",
                    _judged(targets, "gap_left"),
                )
            )
    header = (
        "link",
        "model",
        "DDP default ms",
        "best fixed",
        "`auto` chose (per round)",
        "`auto` step / best fixed (≤ 1.05)",
        "`auto` total / default (≤ 1.01)",
        "repeat (≤ 1.03)",
        "default/best − 1",
        "gap left (≤ 0.20 where ≥ 10%)",
    )
    note = f"Links configured → measured (raw TCP, Gbit/s, per node): {'; '.join(links)}. {_machine(r)}."
    return f"{table(header, rows)}\n\n{note}"


_WAYS = {
    "time_limit": "its time limit (`--time=1 --signal=USR1@5`), twice in a row",
    "scancel_usr1": "`scancel --signal=USR1`",
    "requeue": "`scontrol requeue` (SIGTERM)",
}


def _exits(outcomes: list[str]) -> str:
    """How the ranks' fits ended, as the records say (``exit 138`` -> ``138``)."""
    shown = []
    for outcome in outcomes:
        if outcome == "exit None":
            shown.append("0 (Lightning's SIGTERMException)")
        elif outcome.startswith("exit "):
            shown.append(outcome.split()[1])
        else:
            shown.append(outcome.split(":")[0])
    return ", ".join(sorted(set(shown)))


def cluster_preemption() -> str:
    """``bench/cluster_preemption.py``: ``ddp_tuned`` against stock ``ddp`` under SLURM, three ways of preempting."""
    r = load("cluster_preemption")
    rows = []
    for line in r["summary"]:
        count, runs = line["preemptions"], line["runs"]
        rows.append(
            (
                f"`{line['strategy']}`",
                _WAYS[line["preempted_by"]],
                f"{line['same_step']}/{count}",
                f"{line['saved_stopped_step']}/{count}",
                f"{line['resumed_where_stopped']}/{count}",
                "unknown (a run left no record, or hung)"
                if line["max_redone_steps"] is None
                else str(line["max_redone_steps"]),
                f"{line['exact']}/{runs}",
                f"{line['completed']}/{runs}",
                _exits(line["outcomes"]),
            )
        )
    header = (
        "strategy",
        "preempted by",
        "every rank stopped after one step",
        "that step saved",
        "resumed at that step",
        "steps redone (most)",
        "losses = uninterrupted run",
        "job completed",
        "fit ended with",
    )
    s = r["settings"]
    latencies = [row["signal_to_stopped_s"] for row in r["rows"] if row["signal_to_stopped_s"] is not None]
    gaps = [p["requeue_gap_s"] for row in r["rows"] for p in row["preemptions"] if p["requeue_gap_s"] is not None]
    note = (
        f"{s['nodes']} nodes x {s['ranks_per_node']} rank (gloo across the lab's link), {s['steps']} steps, "
        f"{s['repeats']} job(s) per row; counts are preemptions (stopped, saved, resumed) or jobs (losses, "
        f"completed) that did so. Signals by hand once past step {s['marker_step']}; from a signal to every rank "
        f"stopped: median {statistics.median(latencies):.1f} s; from a run's end to the next run's start (SLURM's "
        f"requeue, then Python and Lightning starting): median {statistics.median(gaps):.0f} s. {_machine(r)}; "
        f"{s['scheduler']}."
    )
    return f"{table(header, rows)}\n\n{note}"


def whatif_sources() -> str:
    """``bench/whatif_sources.py``: one model's 1-rank prediction error taken apart, input by input, per rate."""
    r = load("whatif_sources")
    rows = []
    for row in r["rows"]:
        errors, compute = row["error_pct"], row["compute_ms"]
        rows.append(
            (
                f"{row['rate_gbps']:g} Gbit/s",
                f"{row['achieved_gbps']:.2f} / {row['bench_comm_16mib_gbps']:.2f}",
                f"{row['measured_ms']:.1f}",
                *(f"{errors[name]:+.1f}%" for name in ("nominal", "achieved", "bench_comm", "shared_profile")),
                f"{compute['one_rank']:.1f} / {compute['beside']:.1f} / {compute['lab']:.1f}",
            )
        )
    header = (
        "link",
        "TCP / bench-comm Gbit/s",
        "measured ms",
        "nominal",
        "achieved",
        "bench-comm",
        "+ profile beside a copy",
        "compute ms: alone / beside / in the 2-node run",
    )
    rounds = r["settings"]["rounds"]
    return (
        f"{table(header, rows)}\n\nError of each input's prediction against the measured 2-node step (median of "
        f"{rounds} runs), {r['settings']['model']}; {_machine(r)}; `bench/results/whatif_sources.json`."
    )
