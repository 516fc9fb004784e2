"""The core's facts about service classes: targets are checked, a tenant names only its own
classes, and a policy carrying them stays a hashable value."""

from __future__ import annotations

import math

import pytest

from gateway.core.types import DEFAULT_TENANT, ServiceClass, TenantPolicy

INTERACTIVE = ServiceClass("interactive", ttft_s=1.0, tpot_s=0.05)
BATCH = ServiceClass("batch")


@pytest.mark.parametrize(
    ("service_class", "has_targets"),
    [
        (INTERACTIVE, True),
        (ServiceClass("first-token", ttft_s=2.0), True),
        (ServiceClass("steady", tpot_s=0.1), True),
        (BATCH, False),
    ],
)
def test_a_class_has_targets_when_it_sets_one(service_class: ServiceClass, has_targets: bool):
    assert service_class.has_targets is has_targets


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_targets_are_finite_and_positive(bad: float):
    with pytest.raises(ValueError, match="targets must be > 0"):
        ServiceClass("x", ttft_s=bad)
    with pytest.raises(ValueError, match="targets must be > 0"):
        ServiceClass("x", tpot_s=bad)


def test_a_tenant_may_name_its_own_class_and_its_listed_ones_only():
    tenant = TenantPolicy("t", service_class=INTERACTIVE, service_classes=(BATCH,))
    assert tenant.allowed_class("interactive") is INTERACTIVE  # its own, even unlisted
    assert tenant.allowed_class("batch") is BATCH
    assert tenant.allowed_class("premium") is None
    assert tenant.allowed_class("Batch") is None  # names are exact
    assert DEFAULT_TENANT.allowed_class("batch") is None
    assert DEFAULT_TENANT.service_class is None


def test_a_policy_with_classes_is_a_hashable_value():
    one = TenantPolicy("t", rpm=5, service_class=INTERACTIVE, service_classes=(INTERACTIVE, BATCH))
    same = TenantPolicy(
        "t",
        rpm=5,
        service_class=ServiceClass("interactive", 1.0, 0.05),
        service_classes=(ServiceClass("interactive", 1.0, 0.05), ServiceClass("batch")),
    )
    assert one == same and hash(one) == hash(same)
    assert len({one, same, TenantPolicy("t", rpm=5)}) == 2
