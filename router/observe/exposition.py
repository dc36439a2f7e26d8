"""Prometheus text exposition (format 0.0.4): metric families, a registry of collectors, the renderer.

Why our own and not prometheus-client's: kvrouter used none of its instruments on the request path
(:class:`router.observe.metrics.LeanCounter` and ``LeanHistogram`` replaced them, ~20 us less per
request), only its family classes and its renderer, and importing the package (its HTTP servers,
WSGI and push-gateway helpers come with it) took ~40 ms of a ~0.2 s ``kvrouter serve`` start on the
benchmark box (BENCHMARKS.md, issue 11). What this keeps of prometheus-client's output, so that
dashboards and alerts see the same series: counters are exported with the ``_total`` suffix on their
HELP, TYPE and sample lines; histograms as cumulative ``_bucket{le=...}`` samples, then ``_count``
and ``_sum`` (neither when a bucket bound is negative, which prometheus-client also omits); no
``_created`` series; labels sorted by name on each line; numbers as Go writes them (``1e+06``,
``+Inf``), which matters for ``le`` values, since a label is compared as a string. Tests parse this
output with prometheus-client's parser and compare it with what prometheus-client renders.

A collector is anything with ``collect() -> Iterable[Family]``, called at scrape time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

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


class CounterFamily(Family):
    """A counter: each series is exported as ``<name>_total``."""

    __slots__ = ()

    def __init__(self, name: str, doc: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name.removesuffix("_total"), doc, "counter", labels)

    def add_metric(self, labels: Sequence[str], value: float) -> None:
        """One series: its label values (in the family's label order) and its total."""
        named = dict(zip(self.labelnames, labels, strict=True))
        self.samples.append((self.name + "_total", named, float(value)))


class GaugeFamily(Family):
    """A gauge."""

    __slots__ = ()

    def __init__(self, name: str, doc: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, doc, "gauge", labels)

    def add_metric(self, labels: Sequence[str], value: float) -> None:
        """One series: its label values and its value."""
        self.samples.append((self.name, dict(zip(self.labelnames, labels, strict=True)), float(value)))


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
        base = dict(zip(self.labelnames, labels, strict=True))
        bucket = self.name + "_bucket"
        for le, count in buckets:
            self.samples.append((bucket, {**base, "le": le}, float(count)))
        if buckets and float(buckets[0][0]) >= 0:
            self.samples.append((self.name + "_count", base, float(buckets[-1][1])))
            self.samples.append((self.name + "_sum", base, float(sum_value)))


class Collector(Protocol):
    """What a registry reads at scrape time."""

    def collect(self) -> Iterable[Family]: ...


class Registry:
    """The collectors of one router (each app its own: no process-wide state)."""

    def __init__(self) -> None:
        self._collectors: list[Collector] = []

    def register(self, collector: Collector) -> None:
        """Read ``collector`` at every scrape from now on."""
        self._collectors.append(collector)

    def collect(self) -> Iterator[Family]:
        """Every collector's families, in registration order."""
        for c in list(self._collectors):
            yield from c.collect()

    def render(self) -> bytes:
        """The text exposition of every family."""
        return render(self.collect())


def number(value: float) -> str:
    """A sample value or ``le`` bound as Prometheus's Go clients write it: ``+Inf``, ``-Inf``,
    ``NaN``, and an exponent from 1e+06 up where Python would write all the digits."""
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


def render(families: Iterable[Family]) -> bytes:
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
    "number",
    "render",
]
