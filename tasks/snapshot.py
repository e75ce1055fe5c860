"""inv snapshot.*: recorded runs - list, show, diff, replay, and a report to look at."""
import json as jsonlib
import sys

from invoke import Collection, task

from runtime import settings as settings_mod
from core import names
from core.errors import AnvilError, UserError

# Errors (SettingsError, RunDirError, ReplayError: UserErrors) reach the program's executor,
# which prints them as one line prefixed with the task's name and exits with their code.


TRAINING_TASKS = names.TRAINING_TASKS   # the tasks whose runs end with summary.json


def _settings(c):
    return settings_mod.load(c)


def _load(c, path):
    from runtime.runs import history
    return history.load(path, _settings(c).runs_dir)


def _say_settled(settled) -> None:
    """Runs whose Slurm job, or whose inv, ended without recording it, recorded now (runtime.jobs.settle)."""
    for item in settled:
        print(f"{item.run_dir.name}: {item.why}; recorded as {item.status}", file=sys.stderr)


def _cell(value) -> str:
    return value.get("value") if isinstance(value, dict) else value


@task(auto_shortflags=False, help={"limit": "Show only the newest N runs", "json": "Print JSON"})
def list_(c, limit=0, json=False):
    """Table of recorded runs: time, task, name, status, hosts."""
    from tabulate import tabulate
    from runtime.jobs import settle
    from runtime.runs import history
    runs_dir = _settings(c).runs_dir
    history.check_limit(limit or None)
    _say_settled(settle.settle_runs(runs_dir))
    rows = history.list_rows(runs_dir, limit or None)
    if json:
        print(jsonlib.dumps(rows, indent=2))
        return
    if not rows:
        print(f"no runs under {runs_dir}")
        return
    print(tabulate([[r["start"], r["task"], r["name"], r["status"], r["hosts"], r["seconds"],
                     r["replay_of"], r["dir"]] for r in rows],
                   headers=["start", "task", "name", "status", "hosts", "seconds", "replay of", "directory"]))
    for r in rows:      # below the table, so that one long reason does not widen every row
        if r.get("problem"):
            print(f"{r['dir']}: {r['problem']}")


@task(auto_shortflags=False, help={"run": "Run directory (path, or name under the runs folder)",
                                   "json": "Print JSON"})
def show(c, run, json=False):
    """What a run recorded: outcome, results, machine, versions, environment with sources, configs."""
    from tabulate import tabulate
    from runtime.jobs import settle
    from runtime.runs import history
    rec = _load(c, run)
    settled = settle.settle_run(rec.path)
    if settled:
        _say_settled([settled])
        rec = _load(c, run)
    if json:
        print(jsonlib.dumps({"path": str(rec.path), "metadata": rec.metadata, "results": rec.summary or rec.benchmark or None,
                             "machine": rec.machine, "versions": rec.versions, "env": rec.env,
                             "git": rec.git, "configs": rec.configs}, indent=2, default=str))
        return
    md = rec.metadata
    print(f"{rec.path}\n")
    print(tabulate([["task", md.get("task")], ["name", md.get("name") or ""], ["status", md.get("status")],
                    ["error", md.get("error") or ""], ["start", md.get("start")], ["end", md.get("end")],
                    ["seconds", md.get("duration_s")], ["hosts", history.hosts_text(md)],
                    ["command", history.argv_text(md, skip_program=False)],
                    ["replay of", md.get("replay_of") or ""],
                    ["git", f"{rec.git.get('commit')}{' (dirty)' if rec.git.get('dirty') else ''}"]],
                   tablefmt="plain"))
    results = history.result_rows(rec)
    if results:
        print("\nresults")
        print(tabulate(results, tablefmt="plain"))
    elif rec.summary_problem:
        print(f"\nresults: none ({rec.summary_problem})")
    elif str(md.get("task")) in TRAINING_TASKS:
        print("\nresults: none (no summary.json: the trainer stopped before writing it)")
    print("\nmachine and versions")
    summary = history.machine_summary(rec)
    for key in ("python", "torch", "triton"):
        summary[key] = rec.versions.get(key)
    print(tabulate(sorted(summary.items()), tablefmt="plain"))
    if rec.env:
        print("\nenvironment")
        print(tabulate([[name, _cell(v), v.get("source") if isinstance(v, dict) else ""]
                        for name, v in sorted(rec.env.items())],
                       headers=["variable", "value", "source"]))
    if rec.configs:
        print("\nconfigs: " + ", ".join(sorted(rec.configs)))
    for finding in md.get("diagnosis") if isinstance(md.get("diagnosis"), list) else []:
        if isinstance(finding, dict):
            print(f"\nknown problem [{finding.get('problem')}]: {finding.get('advice')}")


@task(auto_shortflags=False, help={"a": "First run directory", "b": "Second run directory",
                                   "json": "Print JSON"})
def diff(c, a, b, json=False):
    """Result, environment, config, version and machine differences between two runs."""
    from tabulate import tabulate
    from runtime.runs import history
    rows = history.diff(_load(c, a), _load(c, b))
    if json:
        print(jsonlib.dumps(rows, indent=2))
        return
    if not rows:
        print("no differences")
        return
    # wrapped here: tabulate's maxcolwidths int()s a cell such as "7,486" and fails
    print(tabulate([[r["kind"], _wrap(r["key"]), _wrap(r["a"]), _wrap(r["b"])] for r in rows],
                   headers=["kind", "item", f"A ({a})", f"B ({b})"], disable_numparse=True))


def _wrap(text, width: int = 40) -> str:
    import textwrap
    return "\n".join("\n".join(textwrap.wrap(line, width) or [""]) for line in str(text).splitlines() or [""])


@task(auto_shortflags=False, help={"run": "Run directory to replay",
                                   "force": "Replay even on an incompatible machine",
                                   "dry-run": "Show the plan and the command, and what the run names that could "
                                              "run code; run nothing",
                                   "trust-run": "Also replay what the run directory names that can run code (a "
                                                "--patch file, PYTHONPATH, LD_PRELOAD, ...: see --dry-run) "
                                                "when it is not sealed with your own run key"})
def replay(c, run, force=False, dry_run=False, trust_run=False):
    """Run a recorded task again with its recorded config and environment, into a new run."""
    from tabulate import tabulate
    from runtime.runs import replay as replay_mod
    settings = _settings(c)
    plan = replay_mod.plan(run, settings.runs_dir, trusted=trust_run, root=settings.root)
    differences = replay_mod.check_machine(plan.recorded) + replay_mod.check_topology(plan.recorded)
    if differences:
        print(tabulate([[d.item, d.recorded, d.here, "yes" if d.blocking else ""] for d in differences],
                       headers=["differs", "recorded", "this machine", "incompatible"]))
    else:
        print("this machine matches the recorded one (GPU model, count, driver, torch"
              + (", nodes)" if replay_mod.recorded_nodes(plan.recorded.metadata) else ")"))
    for note in plan.dropped:
        print(f"note: {note}")
    if dry_run:
        print(("trusted: " if plan.trusted else "untrusted: ") + plan.trust)
        kept = [item for item in plan.items if item.kept]
        mixed = 0 < len(kept) < len(plan.items)    # your own run: its variables, not the files it names
        if plan.items:
            print(f"the run directory names {len(plan.items)} thing(s) that can run code ("
                  + (f"{len(kept)} replayed: {plan.trust}; the rest left out without --trust-run" if mixed
                     else f"replayed: {plan.trust}" if kept else "left out without --trust-run") + "):")
            for item in plan.items:
                print(f"  {item.line()}" + ((" [replayed]" if item.kept else " [left out]") if mixed else ""))
        else:   # says what was looked at: a replay checks these, not every way code could come in
            print("the run directory names nothing that can run code among what a replay checks: variables "
                  "that load code (env.json, --env, --set env.*, the configs' env: blocks), --patch, -c/-r, "
                  "-f settings files and the working directory")
    blocking = [d.item for d in differences if d.blocking]
    refused = (blocking and not force) or plan.refused
    print(("would replay: inv " if dry_run or refused else "replaying: inv ") + " ".join(plan.argv))
    if dry_run:
        return
    if plan.refused:
        raise UserError(f"replay refused: the run is untrusted ({plan.trust}) and names "
                        + "; ".join(f"{item.what}: {item.why}" for item in plan.refused)
                        + "; --trust-run runs it")
    if refused:
        # A user error (2), not 3: 3 means "checkpointed, requeue me" to a batch script.
        raise UserError(f"replay refused: this machine differs in {', '.join(blocking)}; "
                        f"use --force to replay anyway")
    code, new_run = replay_mod.run(plan)
    if new_run is not None:
        print(f"new run: {new_run} (replay of {plan.recorded.path.name})")
    if code:
        raise AnvilError(f"the replay of {plan.recorded.path.name} exited with status {code}"
                         + (f" (new run: {new_run})" if new_run is not None else ""), exit_code=code)


@task(auto_shortflags=False, iterable=["also"],
      help={"run": "Run directory (path, or name under the runs folder)",
            "also": "Another run to compare with it: curves overlaid, snapshot.diff as a table (repeatable)",
            "out": "Output .html file or folder (default: RUN/report.html; with --also, a dated file in the runs "
                   "folder)",
            "force": "Write over an existing --out file that snapshot.report did not write"})
def report(c, run, also=None, out="", force=False):
    """One self-contained HTML file to look at: charts, tables and the node topology of a run (or several)."""
    from runtime.report import write
    path = write([run, *(also or [])], out or None, _settings(c).runs_dir, force)   # one line, exit 2, on bad input
    print(path)


ns = Collection("snapshot")
ns.add_task(list_, name="list")
ns.add_task(show)
ns.add_task(diff)
ns.add_task(replay)
ns.add_task(report)
