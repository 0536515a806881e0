"""What ``bench/coordinator_capacity.py`` says about a run: whether it measured the
coordinator at all (a run whose load did not keep its schedule measured the machine),
the figures that hold on any machine first (the coordinator's cost per beat over the
floor consumer's, decision latency while a core was spare), then the absolute ones.
Pure: it reads the result dicts the bench builds."""

from __future__ import annotations

import pstats
from collections import Counter
from pathlib import Path
from typing import Any

RATE_VALID = 0.98  # of N beats a second, from the publishers and into the floor
LATE_VALID_MS = 500.0  # the publishers' worst lag behind their schedule
RATIO_TARGET = 3.0  # the coordinator's CPU per beat over the floor's
P99_TARGET_MS = 50.0
CPU_TARGET_PCT = 60.0  # of one core, at every size up to 25,000 nodes (this machine's)
EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 3


def invalid_because(r: dict[str, Any]) -> list[str]:
    """Why the run measured the machine rather than the coordinator; empty: it did not."""
    n, why = r["nodes"], []
    if r["beats_per_s"] < RATE_VALID * n:
        why.append(
            f"the publishers sent {r['beats_per_s']:,.0f} beats/s, under {RATE_VALID:.0%} of {n:,}"
        )
    if r["publisher_late_ms_max"] > LATE_VALID_MS:
        why.append(
            f"a publisher fell {r['publisher_late_ms_max']:,.0f} ms behind its schedule "
            f"(bound {LATE_VALID_MS:.0f} ms)"
        )
    if r["floor_beats_per_s"] < RATE_VALID * r["beats_per_s"]:
        why.append(
            f"the floor decoded {r['floor_beats_per_s']:,.0f} of {r['beats_per_s']:,.0f} "
            "beats/s: not a floor"
        )
    return why


def core_spare(r: dict[str, Any]) -> bool:
    """Whether the machine had a whole core idle over the window (all its users)."""
    idle_cores = (1.0 - r["machine_busy_pct"] / 100.0) * r["cores"]
    return bool(idle_cores >= 1.0)


def exit_code(results: list[dict[str, Any]]) -> int:
    """0: every size ran and is valid; 1: a size failed to run; 3: a size is INVALID."""
    if any("error" in r for r in results):
        return EXIT_FAILED
    if any(not r["valid"] for r in results):
        return EXIT_INVALID
    return EXIT_OK


def _fmt(value: float | None, unit: str = "ms") -> str:
    return "—" if value is None else f"{value:.1f} {unit}"


def lead(r: dict[str, Any]) -> list[tuple[str, str]]:
    """The rows a run leads with: validity, the ratio to the floor, decision latency."""
    spare = "a core to spare" if core_spare(r) else "no core to spare"
    return [
        ("run", "valid" if r["valid"] else "INVALID: " + "; ".join(r["invalid_because"])),
        (
            "cost per beat",
            f"coordinator {r['coordinator_us_per_beat']:.1f} µs, floor "
            f"{r['floor_us_per_beat']:.1f} µs: {r['ratio_to_floor']:.2f}× the floor",
        ),
        (
            "event → decision",
            f"median {_fmt(r['latency_ms_median'])}, p99 {_fmt(r['latency_ms_p99'])}, "
            f"max {_fmt(r['latency_ms_max'])} (machine {r['machine_busy_pct']:.0f} % busy "
            f"of {r['cores']} cores: {spare})",
        ),
    ]


def report(r: dict[str, Any]) -> None:
    n = r["nodes"]
    print(f"\n== {n:,} nodes, {r.get('window_s', 0):.0f} s window ==")
    if "error" in r:
        print(f"  FAILED: {r['error']}  (coordinator log: {r['coordinator_log']})")
        return
    rate = r["beats_per_s"]
    rows = [
        *lead(r),
        (
            "  decisions",
            f"{r['decisions']} of {r['events_sent']} (held by policy {r['held_by_policy']}, "
            f"lost {r['missing']}, unmatched {r['unmatched']})",
        ),
        ("  slowest", "; ".join(r.get("slowest", [])) or "none"),
        *[("  not decided", line) for line in (r["undecided"]["lost"][:5])],
        ("load at start", r["load_at_start"]),
        (
            "heartbeats",
            f"{rate:,.0f}/s of {n:,}/s ({100 * rate / n:.1f} %), {r['beat_bytes']} B, "
            f"from {r['publishers']} publishers at most {r['publisher_late_ms_max']:.0f} ms "
            f"behind; the floor decoded {r['floor_beats_per_s']:,.0f}/s",
        ),
        ("coordinator CPU", f"{r['coordinator_cpu_pct']:.1f} % of one core"),
        ("coordinator RSS", f"{r['coordinator_rss_mib']:.0f} MiB"),
        ("floor CPU", f"{r['floor_cpu_pct']:.1f} % of one core"),
        (
            "node records",
            f"all {n:,} in KV {r['all_node_records_s']:.1f} s after the burst "
            f"(attempt {r.get('attempts', 1)})",
        ),
        (
            "job start",
            f"submit→launch {r['submit_to_launch_s']:.1f} s, →running "
            f"{r['submit_to_running_s']:.1f} s (submit RTT {r['submit_rtt_ms']:.0f} ms)",
        ),
        ("nats-server", f"{r['nats_cpu_pct']:.1f} % CPU, {r['nats_rss_mib']:.0f} MiB"),
        (
            "publishers",
            f"{r['publisher_cpu_pct']:.1f} % CPU in all ({r['publisher_us_per_beat']:.1f} µs "
            "a beat)",
        ),
        ("this script", f"{r['bench_cpu_pct']:.1f} % CPU"),
        ("machine", f"{r['machine_busy_pct']:.0f} % busy of {r['cores']} cores (all users)"),
        ("node.away/lost events", f"{r['node_lost_events']} during the window"),
        (
            "leadership",
            f"{r['leader_events']} coordinator.leader events for one coordinator"
            + (" (it lost its lease and retook it)" if r["leader_events"] > 1 else ""),
        ),
        (
            "node-lost probe",
            "a silenced node found (node.away) "
            + (
                f"{r['node_lost_detect_s']:.1f} s after its agent stopped (spec: ~3 s)"
                if r.get("node_lost_detect_s") is not None
                else "NEVER within the probe timeout"
            ),
        ),
        (
            "log warnings",
            f"coordinator {r['coordinator_log_warnings']} "
            f"(slow consumer {r['coordinator_slow_consumer']}), "
            f"nats slow consumer {r['nats_slow_consumer']}",
        ),
    ]
    for name, value in rows:
        print(f"  {name:<20} {value}")
    for line in r.get("coordinator_log_lines", []):
        print(f"    log: {line}")
    print("  timeline:  t(s)  coord CPU %   beats/s   lat median   lat max")
    for row in r["timeline"]:
        print(
            f"           {row['t_s']:5.0f}  {row['coordinator_cpu_pct']:10.1f}  "
            f"{row['beats_per_s']:8,d}  {_fmt(row['latency_ms_median']):>11}  "
            f"{_fmt(row['latency_ms_max']):>9}"
        )
    if "profile" in r:
        print("  profile of the coordinator during the window:")
        print("\n".join(r["profile"]))


def verdict(results: list[dict[str, Any]]) -> None:
    print("\n== summary ==")
    print("  nodes   run       × floor   p99 ms   core spare   beats/s   coord CPU %   RSS MiB")
    for r in results:
        if "error" in r:
            print(f"  {r['nodes']:>6,}  failed: {r['error']}")
            continue
        print(
            f"  {r['nodes']:>6,}  {'valid' if r['valid'] else 'INVALID':<8}  "
            f"{r['ratio_to_floor']:7.2f}  {r['latency_ms_p99'] or 0:7.1f}  "
            f"{'yes' if core_spare(r) else 'no':>10}  {r['beats_per_s']:8,.0f}  "
            f"{r['coordinator_cpu_pct']:11.1f}  {r['coordinator_rss_mib']:8.0f}"
        )
    for r in results:
        if "error" in r or r["nodes"] < 10_000:
            continue
        if not r["valid"]:
            print(f"  {r['nodes']:,} nodes: INVALID, no verdict: the machine was measured")
            continue
        p99_ok = (r["latency_ms_p99"] or 1e9) <= P99_TARGET_MS and r["missing"] == 0
        checks = {
            f"cost per beat within {RATIO_TARGET:.0f}× the floor's": r["ratio_to_floor"]
            <= RATIO_TARGET,
            f"p99 ≤ {P99_TARGET_MS:.0f} ms with a core to spare": p99_ok if core_spare(r) else None,
            "silenced node lost within 5 s": (r.get("node_lost_detect_s") or 1e9) <= 5.0,
            "leadership held throughout": r["leader_events"] == 1,
            f"coordinator CPU < {CPU_TARGET_PCT:.0f} % of one core (this machine's figure)": r[
                "coordinator_cpu_pct"
            ]
            < CPU_TARGET_PCT,
        }
        for name, ok in checks.items():
            said = "not judged (no core to spare)" if ok is None else ("PASS" if ok else "FAIL")
            print(f"  {r['nodes']:,} nodes: {name}: {said}")


def summarize_pyspy(path: Path, repo: Path, top: int = 18) -> list[str]:
    """Self and inclusive sample shares per function from py-spy's collapsed stacks."""
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [f.split(" (")[0] + " " + _where(f, repo) for f in stack.split(";")]
        own[frames[-1]] += n
        # Inclusive time per function (its line numbers folded together).
        for frame in {f.rsplit(":", 1)[0] + ")" for f in frames}:
            incl[frame] += n
    if not total:
        return ["  (no samples)"]
    lines = [f"  {total} samples; self %  inclusive %  function"]
    for frame, n in own.most_common(top):
        whole = incl[frame.rsplit(":", 1)[0] + ")"]
        lines.append(f"  {100 * n / total:6.1f} {100 * whole / total:11.1f}   {frame}")
    lines.append("  -- inclusive, top functions of the coordinator and nats-py:")
    shown = 0
    for frame, n in incl.most_common():
        if any(f"({p}/" in frame or f"/{p}/" in frame for p in ("nats", "coordinator", "proto")):
            lines.append(f"  {'':6} {100 * n / total:11.1f}   {frame}")
            shown += 1
            if shown >= top:
                break
    return lines


def _where(frame: str, repo: Path) -> str:
    inside = frame.split(" (", 1)[1].rstrip(")") if " (" in frame else ""
    inside = inside.replace(str(repo) + "/", "")
    if "site-packages/" in inside:
        inside = "site-packages/" + inside.split("site-packages/", 1)[1]
    return f"({inside})"


def summarize_cprofile(path: Path, top: int = 25) -> list[str]:
    """The functions with the most time of their own, and the coordinator's and nats-py's
    with the most inclusive time, as shares of the process's busy time (its waits in
    epoll left out), from a cProfile dump of its whole life. cProfile slows the
    coordinator itself: shares, not times, are what it says."""
    stats: dict[Any, Any] = vars(pstats.Stats(str(path)))["stats"]
    idle = sum(v[2] for (_, _, name), v in stats.items() if "select.epoll" in name)
    busy = sum(tt for _, _, tt, _, _ in stats.values()) - idle or 1e-9
    rows = [kv for kv in stats.items() if "select.epoll" not in kv[0][2]]
    lines = [f"  {busy:.1f} s busy; self %  inclusive %  calls  function"]
    for (file, line, name), (_, calls, tt, ct, _) in sorted(rows, key=lambda kv: -kv[1][2])[:top]:
        lines.append(
            f"  {100 * tt / busy:6.1f} {100 * ct / busy:11.1f} {calls:>9,}  {name} "
            f"{_short(file)}:{line}"
        )
    lines.append("  -- inclusive, the coordinator's and nats-py's:")
    ours = [kv for kv in rows if any(p in kv[0][0] for p in ("/coordinator/", "/nats/", "/proto/"))]
    for (file, line, name), (_, calls, _, ct, _) in sorted(ours, key=lambda kv: -kv[1][3])[:top]:
        lines.append(f"  {'':6} {100 * ct / busy:11.1f} {calls:>9,}  {name} {_short(file)}:{line}")
    return lines


def _short(file: str) -> str:
    if "site-packages/" in file:
        return file.split("site-packages/", 1)[1]
    for package in ("coordinator", "proto", "ringmaster"):
        if f"/{package}/" in file:
            return package + "/" + file.split(f"/{package}/", 1)[1]
    return file
