"""A pytest plugin that writes each test's outcome to a JSON-lines file as the test finishes.

    python -m pytest -p looplab.testing.pytest_report --test-report PATH ...

`python -m looplab.gpu_check` runs `pytest -m gpu` with it. Unlike `--junitxml`, written when the session
ends, these lines are on disk as soon as each test is done: a process that dies in a test (a CUDA fault, a
timeout's kill) leaves the outcomes before it, and the name of the test it was running. Under pytest-xdist
the controller writes them (the workers' reports reach it); a worker that crashed is reported as an error of
the test it was running.

Lines, in order:

* `{"collected": [nodeid, ...]}`: the tests selected to run (after `-m`/`-k`), once;
* `{"collection_error": nodeid, "message": ...}`: a module that did not import;
* `{"started": nodeid}`: as a test starts;
* `{"nodeid", "outcome", "duration_s", "message", "properties"}`: as it ends. outcome: passed | failed |
  error (its setup or teardown failed) | skipped | xfailed | xpassed; message: the failure's or the skip's
  text; properties: what the test gave `record_property`, as given (JSON, else its str).
"""

from __future__ import annotations

import json

import pytest

MESSAGE_CHARS = 4000  # an assertion message that prints whole tensors is cut here


def pytest_addoption(parser) -> None:
    parser.addoption("--test-report", metavar="PATH", default=None,
                     help="write each test's outcome and recorded properties to PATH as JSON lines")


def pytest_configure(config) -> None:
    path = config.getoption("--test-report")
    if path and not hasattr(config, "workerinput"):  # an xdist worker: its controller writes the file
        config.pluginmanager.register(OutcomeLog(path), "looplab-test-report")


def _message(report) -> str | None:
    """One readable text for a report: the skip reason, or the exception line(s) pytest shows after `E`."""
    if report.passed:
        return None
    longrepr = report.longrepr
    if report.skipped and isinstance(longrepr, tuple):  # (path, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(longrepr).strip()
    return text[:MESSAGE_CHARS]


def _new(nodeid: str) -> dict:
    return {"nodeid": nodeid, "outcome": "passed", "duration_s": 0.0, "message": None, "properties": {}}


class OutcomeLog:
    def __init__(self, path: str):
        self.file = open(path, "w")
        self.collected = False
        self.tests: dict[str, dict] = {}  # started, not yet written

    def _write(self, record: dict) -> None:
        self.file.write(json.dumps(record, default=str) + "\n")
        self.file.flush()

    def _collected(self, nodeids) -> None:
        if not self.collected:
            self.collected = True
            self._write({"collected": list(nodeids)})

    def pytest_collection_finish(self, session) -> None:
        self._collected(item.nodeid for item in session.items)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids) -> None:  # every worker collects the same ids
        self._collected(ids)

    def pytest_collectreport(self, report) -> None:
        if report.failed:
            self._write({"collection_error": report.nodeid, "message": _message(report)})

    def pytest_runtest_logstart(self, nodeid, location) -> None:
        self._write({"started": nodeid})
        self.tests[nodeid] = _new(nodeid)

    def pytest_runtest_logreport(self, report) -> None:
        test = self.tests.setdefault(report.nodeid, _new(report.nodeid))
        test["duration_s"] = round(test["duration_s"] + report.duration, 3)
        test["properties"].update(dict(report.user_properties))
        xfail = hasattr(report, "wasxfail")
        if report.passed:
            if report.when == "call" and xfail:
                test["outcome"] = "xpassed"
            return
        if test["outcome"] != "passed":  # a teardown error after a failure: the failure is the news
            return
        if report.skipped:
            test["outcome"] = "xfailed" if xfail else "skipped"
        else:
            test["outcome"] = "failed" if report.when == "call" else "error"
        test["message"] = f"expected to fail: {report.wasxfail}" if xfail else _message(report)

    def pytest_runtest_logfinish(self, nodeid, location) -> None:
        self._write(self.tests.pop(nodeid))

    def pytest_sessionfinish(self, session) -> None:
        for nodeid in list(self.tests):  # reported but never finished: xdist's report of a crashed worker
            self._write(self.tests.pop(nodeid))

    def pytest_unconfigure(self, config) -> None:
        self.file.close()
