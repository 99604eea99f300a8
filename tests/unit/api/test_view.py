"""`md.view` is ``mechdiff view``: the same page, byte for byte, for a directory or its `Results`, returned as a
path-like `Report` that a notebook shows."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import mechdiff as md

ROOT = Path(__file__).resolve().parents[3]
IOI = ROOT / "results" / "ioi-smollm2"  # a circuits study's page
CURVE = ROOT / "results" / "curve-smollm2"  # a directory of tables without a study's run.json


def test_view_writes_the_page_mechdiff_view_writes(tmp_path, capsys):
    from mechdiff.cli import main

    assert main(["view", str(IOI), "--out", str(tmp_path / "cli.html")]) == 0
    assert "report: " in capsys.readouterr().out
    report = md.view(IOI, out=tmp_path / "api.html")
    assert report.path == tmp_path / "api.html" and os.fspath(report) == str(tmp_path / "api.html")
    assert (tmp_path / "api.html").read_bytes() == (tmp_path / "cli.html").read_bytes()
    again = md.view(md.Results.load(IOI), out=tmp_path / "results.html")
    assert Path(again).read_bytes() == (tmp_path / "cli.html").read_bytes()


def test_view_refreshes_the_directorys_own_page_and_shows_in_a_notebook(tmp_path, monkeypatch):
    from mechdiff.report.html import page

    copy = tmp_path / "work" / "curve"
    shutil.copytree(CURVE, copy)
    monkeypatch.chdir(tmp_path / "work")
    report = md.view("curve")
    assert report.path == copy / "report.html"
    assert report.path.read_text() == page(copy)  # the page of the directory's files, written in it
    shown = report._repr_html_()
    assert '<iframe src="curve/report.html"' in shown and '<a href="curve/report.html"' in shown
    monkeypatch.chdir(ROOT)  # the page outside the working directory: its path, no frame the server cannot serve
    assert "<iframe" not in report._repr_html_()
