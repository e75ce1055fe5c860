"""`inv snapshot.report` as a newcomer reads it.

The resume mark sits at the checkpoint step a segment went on from (it sat at the first step the
resumed run logged, a log interval late): from the trainer's "resume" record, else the step_N its
--resume named (runs from before the record). The summary names the config file the run started from
(it read "config: run", the name a config without `name:` gets), and a blend's share of the tokens and
val loss per source (also from the metrics of a run without a summary). `--also`'s diff table, opened
in a real Chromium (tests/helpers/browser.py), wraps at spaces: no word broken in two, the table within the
window.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from core.files import seal
from runtime.runs import metrics
from helpers.program import INV, ONE_THREAD, REPO, run_inv



def train_line(step: int) -> dict:
    return {"kind": "train", "step": step, "time": 1.0e9 + step, "loss": 6.0 - step / 10, "tokens_per_s": 1000.0}


def write_metrics_run(path: Path, records: list[dict], resume: str | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "metadata.json").write_text(json.dumps(seal({"task": "train.pretrain", "status": "ok", "resume": resume})))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_resumed_run_is_marked_at_its_checkpoint_step_not_a_log_interval_later(tmp_path):
    """Log interval 5, stopped at step 7 (a signal: its checkpoint is step_7, between two log lines);
    --resume RUN went on from step 7 and logged steps 10, 15, 20."""
    first = write_metrics_run(tmp_path / "a_train.pretrain_x", [train_line(5)])
    second = write_metrics_run(tmp_path / "b_train.pretrain_x",
                       [{"kind": "resume", "step": 7, "time": 0, "checkpoint": f"{first}/checkpoints/step_7"},
                        train_line(10), train_line(15), train_line(20)], resume=str(first))
    curves = metrics.read(second)
    assert curves.resumes == [7]
    assert sorted(curves.train) == [5, 10, 15, 20]


def test_the_resume_record_decides_where_the_earlier_segment_ends(tmp_path):
    """The earlier segment logged steps past the checkpoint the later one went on from (it was killed):
    those steps are not the curve's; the later segment's are."""
    first = write_metrics_run(tmp_path / "a_train.pretrain_x", [train_line(s) for s in (2, 4, 6, 8)])
    second = write_metrics_run(tmp_path / "b_train.pretrain_x",
                       [{"kind": "resume", "step": 5, "time": 0}, train_line(6), train_line(8), train_line(10)], resume=str(first))
    curves = metrics.read(second)
    assert curves.resumes == [5]
    assert sorted(curves.train) == [2, 4, 6, 8, 10]
    assert curves.train[6]["time"] == train_line(6)["time"] and curves.segments == [first, second]


def test_a_requeued_job_resuming_in_its_own_directory_is_marked_at_its_checkpoint(tmp_path):
    run = write_metrics_run(tmp_path / "a_train.pretrain_x",
                    [train_line(s) for s in (2, 4, 6, 8)] + [{"kind": "resume", "step": 6, "time": 0}]
                    + [train_line(s) for s in (8, 10)])
    assert metrics.read(run).resumes == [6]


def test_a_run_from_before_the_resume_record_is_marked_at_the_step_its_resume_named(tmp_path):
    first = write_metrics_run(tmp_path / "a_train.pretrain_x", [train_line(s) for s in (2, 4, 6)])
    second = write_metrics_run(tmp_path / "b_train.pretrain_x", [train_line(s) for s in (8, 10)],
                       resume=f"{first}/checkpoints/step_6")
    assert metrics.read(second).resumes == [6]


def test_a_real_run_resumed_from_its_directory_is_marked_where_the_trainer_went_on(tmp_path, dataset):
    """--resume RUN names no step: the trainer's resume record says it went on from step 7 (its last
    checkpoint), where the first step it logged is 10 (log interval 5)."""
    sets = [f"data.path={dataset}", "data.seq_len=32", "data.batch_size=2", "train.log_interval=5",
            "train.val_interval=0", "train.val_batches=0", "schedule.warmup_steps=2", "checkpoint.interval=0"]
    env = {**os.environ, "INVOKE_ANVIL_RUNS_DIR": str(tmp_path / "runs"), "OMP_NUM_THREADS": "1"}

    def train(*args: str) -> Path:
        before = set((tmp_path / "runs").glob("*")) if (tmp_path / "runs").is_dir() else set()
        done = subprocess.run([str(INV), "train.pretrain", "--name", "mark", *args,
                               *[a for s in sets for a in ("--set", s)]], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        (made,) = set((tmp_path / "runs").glob("*")) - before
        return made
    first = train("--set", "train.steps=7")
    second = train("--set", "train.steps=12", "--resume", str(first))
    records = [json.loads(line) for line in (second / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["kind"] == "resume" and records[0]["step"] == 7, records[0]
    assert records[0]["checkpoint"] == str(first / "checkpoints" / "step_7")
    curves = metrics.read(second)
    assert curves.resumes == [7] and sorted(curves.train) == [5, 7, 10, 12]   # the last step is logged too


# ---------------------------------------------------------------- the page

def inv_into(runs_dir: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The installed inv, its run directories in `runs_dir`, one thread per process."""
    return run_inv(*args, runs=runs_dir, env=ONE_THREAD, timeout=timeout)


@pytest.fixture(scope="module")
def blend_runs(tmp_path_factory, dataset) -> dict[str, Path]:
    """A blend (dataset 70%, another 30%) trained from a config file without `name:`, validated; and a run
    on the default config."""
    import sysconfig

    from trainer.data import prepare

    root = tmp_path_factory.mktemp("newcomer-report")
    other = root / "stdlib10"
    prepare(sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[30:40], other, progress=False)
    config = root / "mine.yaml"
    config.write_text("".join(line for line in (REPO / "configs" / "tiny.yaml").read_text().splitlines(True)
                              if not line.startswith("name:")))
    sets = ["data.seq_len=32", "data.batch_size=4", "train.steps=6", "train.log_interval=2", "train.val_interval=3",
            "train.val_batches=2", "schedule.warmup_steps=2", "checkpoint.interval=0"]
    blend = f"data.blend=[{{path: {dataset}, weight: 0.7}}, {{path: {other}, weight: 0.3, name: other}}]"
    made = inv_into(root / "runs", "train.pretrain", "--config", str(config), "--set", "data.path=null", "--set", blend,
               *[a for s in sets for a in ("--set", s)])
    assert made.returncode == 0, made.stderr[-3000:]
    (blended,) = (root / "runs").iterdir()
    plain = inv_into(root / "runs", "train.pretrain", "--set", f"data.path={dataset}",
                *[a for s in sets for a in ("--set", s)])
    assert plain.returncode == 0, plain.stderr[-3000:]
    (single,) = set((root / "runs").iterdir()) - {blended}
    return {"blend": blended, "single": single, "config": config, "root": root, "dataset": dataset}


def report(blend_runs: dict, *args: str) -> Path:
    made = inv_into(blend_runs["root"] / "runs", "snapshot.report", *args, timeout=120)
    assert made.returncode == 0, made.stderr[-3000:]
    return Path(made.stdout.strip())


def table_rows(page, title: str) -> list[list[str]]:
    """The rows of the table under the <summary> that starts with `title`, as text."""
    return page.evaluate(f"""(function(){{
      var d = Array.from(document.querySelectorAll('details')).find(function(d){{
        return d.querySelector('summary').textContent.indexOf({json.dumps(title)}) === 0; }});
      return d ? Array.from(d.querySelectorAll('tbody tr')).map(function(tr){{
        return Array.from(tr.cells).map(function(td){{ return td.textContent; }}); }}) : null;
    }})()""")


def test_the_summary_names_the_config_file_the_run_started_from(blend_runs, chromium):
    assert blend_runs["blend"].name.endswith("_train.pretrain_run")      # a config without name: is named "run"
    page = chromium.open(report(blend_runs, str(blend_runs["blend"])))
    rows = dict(row for row in table_rows(page, "summary") if len(row) == 2)
    assert rows["config"] == f"{blend_runs['config']} (name: run)"
    single = dict(row for row in table_rows(chromium.open(report(blend_runs, str(blend_runs["single"]))), "summary"))
    assert single["config"] == str(REPO / "configs" / "tiny.yaml")    # the default, named as its file


def shares(rows: list[list[str]]) -> dict[str, str]:
    return {name.strip(): text for name, text in rows if name.startswith("  ")}


def test_a_blends_shares_and_val_loss_per_source_are_in_the_summary(blend_runs, chromium):
    page = chromium.open(report(blend_runs, str(blend_runs["blend"])))
    rows = table_rows(page, "summary")
    said = shares(rows)
    assert set(said) == {blend_runs["dataset"].name, "other"}, rows
    for name, weight in ((blend_runs["dataset"].name, "70.0%"), ("other", "30.0%")):
        assert re.fullmatch(rf"\d+\.\d% of the tokens \(weight {re.escape(weight)}\), \d+\.\d\d epochs, "
                            rf"val loss \d+\.\d{{4}}", said[name]), said[name]
    labels = [row[0] for row in rows]
    assert labels.index("data") < labels.index(f"  {blend_runs['dataset'].name}") < labels.index("config")


def test_a_blend_without_a_summary_is_shown_from_its_metrics(blend_runs, chromium, tmp_path):
    copy = tmp_path / "runs" / blend_runs["blend"].name
    shutil.copytree(blend_runs["blend"], copy, ignore=shutil.ignore_patterns("checkpoints", "report.html"))
    (copy / "summary.json").unlink()
    (copy / "result.json").unlink()
    made = inv_into(tmp_path / "runs", "snapshot.report", copy.name, timeout=120)
    assert made.returncode == 0, made.stderr[-3000:]
    last = [json.loads(line) for line in (copy / "metrics.jsonl").read_text().splitlines()]
    tokens = [r for r in last if r["kind"] == "train"][-1]
    val = [r for r in last if r["kind"] == "val"][-1]
    said = shares(table_rows(chromium.open(Path(made.stdout.strip())), "blend: each source so far"))
    name = blend_runs["dataset"].name
    share = tokens[f"tokens/{name}"] / (tokens[f"tokens/{name}"] + tokens["tokens/other"])
    assert said[name] == f"{share:.1%} of the tokens (weight 70.0%), val loss {val[f'val_loss/{name}']:.4f}"


LONG_TOKEN = 32     # runtime.report.page.LONG_TOKEN: a longer word may break anywhere
# Every word of the table's text that spans two lines (a range over it with boxes at two heights).
BROKEN_WORDS = """(function(title){
  var d = Array.from(document.querySelectorAll('details')).find(function(d){
    return d.querySelector('summary').textContent.indexOf(title) === 0; });
  d.open = true;
  var out = [], walker = document.createTreeWalker(d.querySelector('table'), NodeFilter.SHOW_TEXT), node;
  while ((node = walker.nextNode())) {
    var re = /\\S+/g, m;
    while ((m = re.exec(node.data))) {
      var r = document.createRange(); r.setStart(node, m.index); r.setEnd(node, m.index + m[0].length);
      var tops = new Set(Array.from(r.getClientRects()).map(function(x){ return Math.round(x.top); }));
      if (tops.size > 1) out.push(m[0]);
    }
  }
  return {broken: out, right: d.querySelector('table').getBoundingClientRect().right, width: window.innerWidth};
})"""


@pytest.mark.parametrize("width", [1400, 800])
def test_the_also_diff_table_wraps_at_spaces_and_fits_the_window(blend_runs, chromium, tmp_path, width):
    """Its cells broke words anywhere (word-break: break-word), and the table squeezed its narrow columns
    to a few letters: "resu|lt", "conf|ig", "--|set". A word breaks only where it is longer than
    LONG_TOKEN (a path, a digest: overflow-wrap: anywhere on it alone)."""
    out = report(blend_runs, str(blend_runs["blend"]), "--also", str(blend_runs["single"]), "--out", str(tmp_path / "both.html"))
    page = chromium.open(out)
    chromium.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": 900, "deviceScaleFactor": 1,
                                                         "mobile": False}, session=page.session)
    seen = page.evaluate(f"({BROKEN_WORDS})('snapshot.diff')")
    assert [w for w in seen["broken"] if len(w) <= LONG_TOKEN] == [], seen["broken"]   # hyphens, slashes too
    assert seen["right"] <= seen["width"], seen
    rows = table_rows(page, "snapshot.diff")
    assert ["run", "argv"] == rows[-1][:2] and "--set" in rows[-1][2]
