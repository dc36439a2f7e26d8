"""kvrouter's Prometheus text (router/observe/exposition.py) against prometheus-client's, family by
family: the same bytes for the same families, and the same series once parsed where the two only
write a number differently."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from router.observe import exposition
from router.observe.exposition import (
    CounterFamily,
    Family,
    GaugeFamily,
    HistogramFamily,
    Registry,
    number,
    render,
)

# (kind, name, doc, label names, series); a series is (label values, value) or, for histograms,
# (label values, [(le, cumulative count)...], sum)
Case = tuple[str, str, str, list[str], list[Any]]
CASES: list[Case] = [
    ("counter", "t_requests", "Requests", ["backend", "status"], [(["a", "2xx"], 3), (["b", "5xx"], 0.5)]),
    ("counter", "t_named_total", "the suffix is not doubled", [], [([], 7)]),
    ("counter", "t_zero", "no series yet", ["x"], []),
    ("gauge", "t_unlabelled", "one value", [], [([], 42)]),
    ("gauge", "t_sorted", "labels are sorted on each line", ["zeta", "alpha"], [(["z", "a"], 1)]),
    (
        "gauge",
        "t_escapes",
        'help with a \\ backslash and a\nnewline and "quotes"',
        ["v"],
        [([r"back\slash"], 1), (["new\nline"], 2), (['a "quote"'], 3), (["unicode é ✓"], 4)],
    ),
    (
        "gauge",
        "t_numbers",
        "how numbers are written",
        ["n"],
        [
            (["small"], 1e-7),
            (["neg"], -2.5),
            (["neg_large"], -12345678.0),
            (["million"], 1e6),
            (["large"], 1234567.25),
            (["billion"], 1e9 + 0.5),
            (["int"], 123456),
            (["inf"], math.inf),
            (["minus_inf"], -math.inf),
        ],
    ),
    (
        "histogram",
        "t_seconds",
        "latency",
        ["backend"],
        [
            (["a"], [("0.005", 1), ("0.1", 4), ("1.0", 4), ("+Inf", 6)], 12.5),
            (["b"], [("0.005", 0), ("0.1", 0), ("1.0", 0), ("+Inf", 0)], 0),
        ],
    ),
    (
        "histogram",
        "t_error_tokens",
        "negative bounds: no count or sum",
        [],
        [([], [("-16.0", 1), ("0.0", 3), ("16.0", 5), ("+Inf", 6)], -4.0)],
    ),
]

_OURS = {"counter": CounterFamily, "gauge": GaugeFamily, "histogram": HistogramFamily}
_THEIRS = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "histogram": HistogramMetricFamily}


def _both(cases: Iterable[Case]) -> tuple[bytes, bytes]:
    ours: list[Family] = []
    theirs: list[Any] = []
    for kind, name, doc, labels, series in cases:
        a, b = _OURS[kind](name, doc, labels), _THEIRS[kind](name, doc, labels=labels)
        for s in series:
            a.add_metric(*s)  # type: ignore[attr-defined]
            b.add_metric(*s)
        ours.append(a)
        theirs.append(b)

    class _Theirs:
        def collect(self) -> Any:
            return theirs

        def describe(self) -> Any:
            return []

    reg = CollectorRegistry()
    reg.register(_Theirs())  # type: ignore[arg-type]
    return render(ours), generate_latest(reg)


@pytest.mark.parametrize("case", CASES, ids=[c[1] for c in CASES])
def test_each_family_renders_as_prometheus_client_does(case: Case) -> None:
    ours, theirs = _both([case])
    assert ours == theirs


def test_a_registry_renders_every_collector_in_order() -> None:
    reg = Registry()
    groups = [CASES[:3], CASES[3:]]
    for group in groups:

        class _C:
            def __init__(self, cases: list[Case]) -> None:
                self.cases = cases

            def collect(self) -> Iterable[Family]:
                for kind, name, doc, labels, series in self.cases:
                    fam = _OURS[kind](name, doc, labels)
                    for s in series:
                        fam.add_metric(*s)  # type: ignore[attr-defined]
                    yield fam

        reg.register(_C(group))
    assert reg.render() == _both(CASES)[1]


def _parsed(text: bytes) -> list[tuple[str, str, str, list[tuple[str, dict[str, str], float]]]]:
    return [
        (f.name, f.type, f.documentation, [(s.name, s.labels, s.value) for s in f.samples])
        for f in text_string_to_metric_families(text.decode())
    ]


def test_beyond_1e10_the_text_differs_but_the_series_are_the_same() -> None:
    # prometheus-client writes 1.2e+010 there, Go (and this module) 1.2e+10: the same number
    case = ("gauge", "t_huge", "huge", ["n"], [(["a"], 12345678901.0), (["b"], 2e15)])
    ours, theirs = _both([case])
    assert b't_huge{n="a"} 1.2345678901e+10' in ours
    assert _parsed(ours) == _parsed(theirs)


def test_nan_is_written_as_nan() -> None:
    fam = GaugeFamily("t_nan", "not a number")
    fam.add_metric([], math.nan)
    assert render([fam]) == b"# HELP t_nan not a number\n# TYPE t_nan gauge\nt_nan NaN\n"


def test_numbers() -> None:
    assert [number(v) for v in (0.0, 1.0, 0.005, 300, 1e6, 999999.5, 25e-6)] == [
        "0.0",
        "1.0",
        "0.005",
        "300.0",
        "1e+06",
        "999999.5",
        "2.5e-05",
    ]


def test_a_fault_in_one_part_never_fails_a_scrape(caplog: pytest.LogCaptureFixture) -> None:
    """A series with the wrong number of label values is left out, a collector that raises is left
    out of that scrape; the rest renders, and each fault is logged once."""
    exposition._logged.clear()  # (once per process: start this test from none)
    good = CounterFamily("t_good", "doc", ["a"])
    good.add_metric(["x"], 1)
    bad = CounterFamily("t_bad", "doc", ["a", "b"])
    bad.add_metric(["only one"], 1)
    bad.add_metric(["x", "y"], 2)
    assert [s[1] for s in bad.samples] == [{"a": "x", "b": "y"}]

    class _Broken:
        def collect(self) -> Iterable[Family]:
            yield good
            raise RuntimeError("boom")

    class _Fine:
        def collect(self) -> Iterable[Family]:
            return [good, bad]

    reg = Registry()
    reg.register(_Broken())
    reg.register(_Fine())
    with caplog.at_level("ERROR", logger="kvrouter.metrics"):
        first, second = reg.render(), reg.render()
    assert first == second == render([good, bad])  # (the broken collector's one good family: left out)
    assert reg.faults == 2
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2 and "t_bad" in logged[0] and "boom" in logged[1], logged
