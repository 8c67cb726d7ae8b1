"""``config_changes``: a record written before a field existed reads as what the field's absence meant
(``option(absent_means=...)``), in a section too; an ``omit_at_default`` section at its default and a field
that does not affect output are not recorded at all."""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.core.config import build, option, output_dict
from toolkit.core.config_changes import absent_values, changed_keys


@dataclass(frozen=True)
class Gamma:
    """A section; ``rule`` was added later."""

    start: float = option(1.0, doc="γ at step 0.")
    rule: str = option("cosine", absent_means="constant", doc="Added later; records before it were constant.")


@dataclass(frozen=True)
class Extra:
    """A section added later (omit_at_default) holding a field that declares what its absence meant."""

    weight: float = option(0.0, absent_means=0.0, doc="Added later; 0 is the old behaviour.")


@dataclass(frozen=True)
class Run:
    steps: int = option(10, doc="Steps.")
    gamma: Gamma = option(factory=Gamma, doc="γ.")
    extra: Extra = option(factory=Extra, omit_at_default=True, doc="Added later.")
    workers: int = option(2, absent_means=2, affects_output=False, doc="Loader workers (not in the record).")


def _old_record(cfg: Run) -> dict:
    """``cfg``'s record as written before ``gamma.rule`` existed: the key ``gamma.rule`` absent."""
    record = output_dict(cfg)
    del record["gamma"]["rule"]
    return record


def test_absent_keys_are_named_as_records_name_them():
    assert absent_values(build(Run, {})) == {"gamma.rule": "constant", "extra.weight": 0.0, "workers": 2}


def test_a_record_without_a_sectioned_field_reads_as_its_absence_meant():
    same = build(Run, {"gamma": {"rule": "constant"}})
    assert changed_keys(_old_record(same), output_dict(same), absent_values(same)) == []
    other = build(Run, {"gamma": {"rule": "linear"}})
    assert changed_keys(_old_record(same), output_dict(other), absent_values(other)) == [
        ("gamma.rule", "constant", "linear")
    ]


def test_keys_the_new_record_omits_are_no_change():
    """An omit_at_default section at its default and a field outside the hash are in neither record."""
    cfg = build(Run, {"gamma": {"rule": "constant"}, "workers": 4})
    assert "extra" not in output_dict(cfg) and "workers" not in output_dict(cfg)
    assert changed_keys(_old_record(cfg), output_dict(cfg), absent_values(cfg)) == []
    weighted = build(Run, {"gamma": {"rule": "constant"}, "extra": {"weight": 0.5}})
    assert changed_keys(_old_record(cfg), output_dict(weighted), absent_values(weighted)) == [
        ("extra.weight", 0.0, 0.5)
    ]
