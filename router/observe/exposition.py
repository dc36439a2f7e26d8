"""Prometheus text exposition (format 0.0.4): metric families, a registry of collectors, the renderer.

Why our own and not prometheus-client's: kvrouter used none of its instruments on the request path
(:class:`router.observe.metrics.LeanCounter` and ``LeanHistogram`` replaced them, ~20 us less per
request), only its family classes and its renderer, and importing the package (its HTTP servers,
WSGI and push-gateway helpers come with it) took ~40 ms of a ~0.2 s ``kvrouter serve`` start on the
benchmark box. What this keeps of prometheus-client's output, so that
dashboards and alerts see the same series: counters are exported with the ``_total`` suffix on their
HELP, TYPE and sample lines; histograms as cumulative ``_bucket{le=...}`` samples, then ``_count``
and ``_sum`` (neither when a bucket bound is negative, which prometheus-client also omits); no
``_created`` series; labels sorted by name on each line; numbers as prometheus-client writes them
(Go's ``1e+06`` for positive values from a million up, ``+Inf``; Python's repr otherwise), which
matters for ``le`` values, since a label is compared as a string. Tests parse this
output with prometheus-client's parser and compare it with what prometheus-client renders.

A collector is anything with ``collect() -> Iterable[Family]``, called at scrape time. A fault in one
never fails a scrape: a series whose label values do not match its family's names is left out
(prometheus-client silently cut or padded it), and a collector that raises is left out of that
scrape and counted in :attr:`Registry.faults`; each kind of fault is logged once (kvrouter.metrics).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

log = logging.getLogger("kvrouter.metrics")
_logged: set[tuple[str, str]] = set()
"""(where, what) faults logged so far: each once per process (a scrape every 15 s would repeat them)."""


def _fault(where: str, what: str) -> None:
    if (where, what) not in _logged and len(_logged) < 1000:
        _logged.add((where, what))
        log.error("metrics: %s: %s (logged once)", where, what)


Sample = tuple[str, dict[str, str], float]
"""(sample name, labels, value)."""


class Family:
    """One metric family: its name, help text, type and samples, as a collector builds it."""

    __slots__ = ("doc", "labelnames", "name", "samples", "type")

    def __init__(self, name: str, doc: str, type: str, labels: Sequence[str] = ()) -> None:
        self.name = name
        self.doc = doc
        self.type = type
        self.labelnames = list(labels)
        self.samples: list[Sample] = []

    def add_sample(self, name: str, labels: dict[str, str], value: float) -> None:
        """A sample as is (the workers' merge rebuilds families from their samples)."""
        self.samples.append((name, labels, float(value)))

    def _labels(self, values: Sequence[str]) -> dict[str, str] | None:
        """The series' labels by name; None (logged once) when the count does not match."""
        if len(values) != len(self.labelnames):
            _fault(self.name, f"a series with {len(values)} label values for {self.labelnames} left out")
            return None
        return dict(zip(self.labelnames, values, strict=True))


class CounterFamily(Family):
    """A counter: each series is exported as ``<name>_total``."""

    __slots__ = ()

    def __init__(self, name: str, doc: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name.removesuffix("_total"), doc, "counter", labels)

    def add_metric(self, labels: Sequence[str], value: float) -> None:
        """One series: its label values (in the family's label order) and its total."""
        named = self._labels(labels)
        if named is not None:
            self.samples.append((self.name + "_total", named, float(value)))


class GaugeFamily(Family):
    """A gauge."""

    __slots__ = ()

    def __init__(self, name: str, doc: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, doc, "gauge", labels)

    def add_metric(self, labels: Sequence[str], value: float) -> None:
        """One series: its label values and its value."""
        named = self._labels(labels)
        if named is not None:
            self.samples.append((self.name, named, float(value)))


class HistogramFamily(Family):
    """A histogram, from cumulative bucket counts."""

    __slots__ = ()

    def __init__(self, name: str, doc: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, doc, "histogram", labels)

    def add_metric(
        self, labels: Sequence[str], buckets: Sequence[tuple[str, float]], sum_value: float
    ) -> None:
        """One series: (``le`` text, cumulative count) per bucket, ``+Inf`` last, and the sum of the
        observations. The count is the ``+Inf`` bucket's."""
        base = self._labels(labels)
        if base is None:
            return
        bucket = self.name + "_bucket"
        for le, count in buckets:
            self.samples.append((bucket, {**base, "le": le}, float(count)))
        if buckets and float(buckets[0][0]) >= 0:
            self.samples.append((self.name + "_count", base, float(buckets[-1][1])))
            self.samples.append((self.name + "_sum", base, float(sum_value)))

    def add_counts(
        self, labels: Sequence[str], bounds: Sequence[float], counts: Sequence[float], sum_value: float
    ) -> None:
        """One series from per-bucket counts: ``counts[i]`` observations at or below ``bounds[i]``
        (and above the bound before), then one more count, of those above the last bound."""
        buckets: list[tuple[str, float]] = []
        total = 0.0
        for bound, n in zip((*bounds, math.inf), counts, strict=True):
            total += n
            buckets.append((number(bound), total))
        self.add_metric(labels, buckets, sum_value)


class Collector(Protocol):
    """What a registry reads at scrape time."""

    def collect(self) -> Iterable[Family]: ...


class Registry:
    """The collectors of one router (each app its own)."""

    def __init__(self) -> None:
        self._collectors: list[Collector] = []
        self.faults = 0
        """Collectors that raised, over every scrape so far."""

    def register(self, collector: Collector) -> None:
        """Read ``collector`` at every scrape from now on."""
        self._collectors.append(collector)

    def collect(self) -> Iterator[Family]:
        """Every collector's families, in registration order; a collector that raises is left out
        of this scrape (whole: none of its families, rather than some)."""
        for c in list(self._collectors):
            try:
                families = list(c.collect())
            except Exception as exc:  # a bug in one part's figures must not take down /metrics
                self.faults += 1
                _fault(type(c).__name__, f"collector raised {type(exc).__name__}: {exc}")
                continue
            yield from families

    def render(self) -> bytes:
        """The text exposition of every family."""
        return render(self.collect())


def number(value: float) -> str:
    """A sample value or ``le`` bound as prometheus-client writes it: ``+Inf``, ``-Inf``, ``NaN``,
    Go's exponent for positive values from 1e+06 up (``1.5e+07``: Python would write all the
    digits), Python's repr otherwise."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    text = repr(float(value))
    whole, dot, frac = text.partition(".")
    if value > 0 and dot and len(whole) > 6:
        mantissa = f"{whole[0]}.{whole[1:]}{frac}".rstrip("0").rstrip(".")
        return f"{mantissa}e+{len(whole) - 1:02d}"
    return text


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


_HEAD_NAME = {"counter": "_total"}
_TEXT_TYPE = {"unknown": "untyped"}


class Rendered(Protocol):
    """What :func:`render` reads of a family (a :class:`Family`, or the workers' snapshot of one)."""

    name: str
    doc: str
    type: str
    samples: list[Sample]


def render(families: Iterable[Rendered]) -> bytes:
    """Families as Prometheus text: ``# HELP`` and ``# TYPE`` lines, then one line per sample."""
    out: list[str] = []
    for fam in families:
        head = fam.name + _HEAD_NAME.get(fam.type, "")
        doc = fam.doc.replace("\\", "\\\\").replace("\n", "\\n")
        out.append(f"# HELP {head} {doc}\n# TYPE {head} {_TEXT_TYPE.get(fam.type, fam.type)}\n")
        for name, labels, value in fam.samples:
            if labels:
                inner = ",".join(f'{k}="{_escape_label(v)}"' for k, v in sorted(labels.items()))
                out.append(f"{name}{{{inner}}} {number(value)}\n")
            else:
                out.append(f"{name} {number(value)}\n")
    return "".join(out).encode()


__all__ = [
    "Collector",
    "CounterFamily",
    "Family",
    "GaugeFamily",
    "HistogramFamily",
    "Registry",
    "Rendered",
    "number",
    "render",
]
