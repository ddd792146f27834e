"""The run directory's format (tracekit/rundir): records round-trip, versions are checked,
missing fields and unreadable files are errors that name the file, the version-1 reference
directory stays readable, and the report shows every read error on its cell."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tracekit.analyze import CLASSES
from tracekit.analyze.run_report import write_report
from tracekit.errors import SchemaVersionError, TraceFormatError
from tracekit.rundir import (
    DIFF_CLASSES,
    Cell,
    CellRecord,
    Check,
    DiffRef,
    EngineRecord,
    Manifest,
    RunDir,
    TeacherRef,
)

ROOT = Path(__file__).resolve().parents[3]
V1 = ROOT / "fixtures" / "matrix" / "rundir-v1"
BF16 = "ref.bf16.cache-on.prefix8.out32.c8"
FP32 = "ref.fp32.cache-on.prefix8.out32.c8"
CELL = Cell("ref", "bf16", True, "prefix8", 32, 8)


def _diff_doc() -> dict:
    """A real tracekit.diff/1 document (one bf16_tie_flip pair among 8)."""
    return json.loads((V1 / "cells" / BF16 / "diff.json").read_text())


def _write_run(root: Path) -> tuple[RunDir, CellRecord, Manifest]:
    rd = RunDir.create(root, "name = 'x'\n")
    eng = EngineRecord(
        CELL.engine_id,
        "ref",
        "tracekit",
        "engines/e.log",
        ("tracekit", "serve"),
        "http://127.0.0.1:1",
        1.5,
        0,
        {},
        None,
    )
    rd.write_engine(eng)
    ref = rd.write_diff(CELL.id, _diff_doc(), rd.serial_rel(CELL.group_id), rd.burst_rel(CELL.id))
    rec = CellRecord(
        CELL,
        rd.serial_rel(CELL.group_id),
        rd.burst_rel(CELL.id),
        (Check("completion_burst", "pass", "8/8 completed", {"planned": 8}), Check("cancel_drain", "skip", "no")),
        ref,
        TeacherRef(rd.teacher_rel(CELL.id), ("c0",), "full,decode", "fp32", "/m"),
    )
    rd.write_cell(rec)
    man = Manifest(
        "tracekit 0", "abc", "tracekit run m.toml", {"cpus": 2}, "t0", "t1", "m", "/m.toml", (CELL.id,), (eng,), {}
    )
    rd.write_manifest(man)
    return RunDir(root), rec, man


def test_records_round_trip(tmp_path):
    """What the runner writes is what the report reads, field for field."""
    rd, rec, man = _write_run(tmp_path / "run")
    assert rd.read_cell(CELL.id) == rec
    assert rd.read_manifest() == man
    loaded = rd.load_cell(CELL.id)
    assert loaded.diff_error is None and loaded.passed
    assert loaded.diff.counts["bf16_tie_flip"] == 1 and loaded.diff.n_pairs == 8
    (flip,) = [p for p in loaded.diff.pairs if p.cls != "identical"]
    assert (flip.key, flip.position, flip.boundary_b) == ("c0", 3, 32)


def test_diff_classes_match_the_classifier():
    """The run directory reads diff summaries by the classifier's class names."""
    assert set(DIFF_CLASSES) == set(CLASSES)


def _edit(path: Path, fn) -> None:
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize(
    "rel,kind",
    [("manifest.json", "tracekit.run-manifest"), (f"cells/{CELL.id}/cell.json", "tracekit.cell")],
)
def test_newer_version_names_both_versions(tmp_path, rel, kind):
    """A directory written by a newer tracekit is refused with both versions named, never half read."""
    rd, _, _ = _write_run(tmp_path / "run")
    _edit(rd.path(rel), lambda d: d.update(schema=f"{kind}/3"))
    with pytest.raises(SchemaVersionError) as e:
        rd.load()
    msg = str(e.value)
    assert "version 3" in msg and "(version 2)" in msg and rel in msg


@pytest.mark.parametrize(
    "rel,field",
    [
        (f"cells/{CELL.id}/cell.json", "burst"),
        (f"cells/{CELL.id}/checks.json", "checks"),
        ("manifest.json", "files"),
        ("manifest.json", "engines"),
    ],
)
def test_missing_field_is_an_error_never_a_guess(tmp_path, rel, field):
    rd, _, _ = _write_run(tmp_path / "run")
    _edit(rd.path(rel), lambda d: d.pop(field))
    with pytest.raises(TraceFormatError) as e:
        rd.load()
    assert f"missing field {field!r}" in str(e.value) and rel in str(e.value)


def test_cell_json_must_match_its_directory(tmp_path):
    rd, _, _ = _write_run(tmp_path / "run")
    _edit(rd.path(f"cells/{CELL.id}/cell.json"), lambda d: d["cell"].update(concurrency=4))
    with pytest.raises(TraceFormatError, match="does not match the axes"):
        rd.load()


@pytest.mark.parametrize(
    "damage,needle",
    [
        (lambda p: p.write_text(p.read_text()[:200]), "not valid JSON"),
        (lambda p: _edit(p, lambda d: d.update(schema="tracekit.diff/3")), "version 3 is newer"),
        (lambda p: _edit(p, lambda d: d["summary"].pop("unexplained")), "missing field 'unexplained'"),
        (lambda p: _edit(p, lambda d: d["pairs"].pop()), "summary says 8 pairs, the file lists 7"),
        (lambda p: p.unlink(), "missing"),
    ],
)
def test_unreadable_diff_fails_its_cell_with_the_reason(tmp_path, damage, needle):
    """A corrupt diff.json is a read error on the cell (which then fails), never "no diff"."""
    rd, _, _ = _write_run(tmp_path / "run")
    damage(rd.path(rd.diff_rel(CELL.id)))
    (loaded,) = rd.load()[1]
    assert loaded.diff is None and not loaded.passed
    assert loaded.diff_error.startswith("diff unreadable: ") and needle in loaded.diff_error
    report = write_report(rd.root, plots=False)
    assert report.failed_cells == [CELL.id]
    assert needle in report.markdown and report.summary["cells"][0]["diff_error"] == loaded.diff_error


def test_killed_run_is_readable_without_a_manifest(tmp_path):
    """Cells are written as they finish; a run killed before its diffs reads as 'not computed'."""
    rd = RunDir.create(tmp_path / "run", "")
    rd.write_cell(CellRecord(CELL, None, None, (Check("engine_start", "fail", "did not start"),)))
    man, (loaded,) = rd.load()
    assert man is None and loaded.diff_error.startswith("not computed") and not loaded.passed


def test_existing_run_is_never_overwritten(tmp_path):
    _write_run(tmp_path / "run")
    from tracekit.errors import ConfigError

    with pytest.raises(ConfigError, match="already holds a run"):
        RunDir.create(tmp_path / "run", "")


def test_version_1_reference_directory_reads_forever(tmp_path):
    """fixtures/matrix/rundir-v1 (the layout before versioning, as tracekit 0.1.0 wrote it) is
    upgraded on read: diff references from the manifest's diff_error, teacher-forced keys from
    its teacher_forced, engines without an id field."""
    rd = RunDir(V1)
    man, cells = rd.load()
    assert man.version == 1 and man.cells == (FP32, BF16)
    assert {e.engine_id for e in man.engines} == {"ref.fp32.cache-on", "ref.bf16.cache-on"}
    assert man.engine("ref.bf16.cache-on").self_report["v1_models"]["data"][0]["meta"]["dtype"] == "bf16"
    fp32, bf16 = cells
    assert fp32.passed and fp32.diff.identical == 8 and fp32.record.teacher is None
    assert bf16.passed and bf16.diff.counts["bf16_tie_flip"] == 1
    assert bf16.record.teacher.keys == ("c0",) and bf16.record.diff == DiffRef(f"cells/{BF16}/diff.json", None)
    assert [c.name for c in bf16.record.checks][:2] == ["completion_serial", "completion_burst"]


def test_version_1_cell_without_its_manifest_is_an_error(tmp_path):
    shutil.copytree(V1, tmp_path / "v1")
    (tmp_path / "v1" / "manifest.json").unlink()
    with pytest.raises(TraceFormatError, match="missing field 'schema'"):
        RunDir(tmp_path / "v1").load()


def test_report_is_the_pr_evidence(tmp_path):
    """report.md carries every non-identical pair with its evidence, says what A and B are,
    and says the plots are attachments (relative image links do not survive a paste)."""
    shutil.copytree(V1, tmp_path / "v1")
    report = write_report(tmp_path / "v1", plots=False)
    md = report.markdown
    assert "**A and B.**" in md and "serial baseline" in md and "concurrent burst" in md
    assert "### Non-identical pairs (1)" in md
    (row,) = [line for line in md.splitlines() if line.startswith("| ref BF16 cache-on prefix8 c8")]
    for part in ("| c0 ", "bf16_tie_flip", "| 3 ", "321 / 348", "0 / 32", "\\|gap\\| A 0 nats", "reproduced by"):
        assert part in row, part
    # The traces are not in the fixture: said on each cell, without failing it.
    assert "burst trace unreadable" in md and not report.failed_cells
    assert report.summary["cells"][1]["divergent"][0]["key"] == "c0"


def test_unreadable_cell_is_reported_and_the_others_still_read(tmp_path):
    """A corrupt cell.json fails that cell in the report with the reason; the rest is still read.
    The strict load() refuses the directory."""
    rd, _, _ = _write_run(tmp_path / "run")
    other = Cell("ref", "bf16", True, "prefix8", 32, 4)
    rd.write_cell(CellRecord(other, None, None, (Check("engine_start", "fail", "did not start"),)))
    _edit(rd.path("manifest.json"), lambda d: d.update(cells=[CELL.id, other.id]))
    rd.path(f"cells/{CELL.id}/checks.json").write_text("{")
    view = RunDir(rd.root).view()
    assert [c.cell.id for c in view.cells] == [other.id]
    assert view.unreadable[0][0] == CELL.id and "not valid JSON" in view.unreadable[0][1]
    with pytest.raises(TraceFormatError, match="not valid JSON"):
        RunDir(rd.root).load()
    report = write_report(rd.root, plots=False)
    assert set(report.failed_cells) == {CELL.id, other.id} and "0/2 cells pass" in report.markdown
    assert f"**{CELL.id}**: unreadable:" in report.markdown
