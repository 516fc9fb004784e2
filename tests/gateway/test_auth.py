import hashlib

import pytest

from gateway.auth import AdminGate, Authenticator, policy_of
from gateway.cli import main
from gateway.config import ConfigError, parse_config
from gateway.core.types import ServiceClass, TenantPolicy
from gateway.errors import BadRequest, Forbidden, Unauthorized


def cfg_with(keys):
    return parse_config(
        {
            "engines": [{"url": "http://127.0.0.1:9"}],
            "tenants": [{"name": "a", "api_keys": keys, "rpm": 10, "kv_share": 0.5}],
        }
    )


def test_hash_key_cli_prints_a_digest_the_config_accepts(capsys):
    assert main(["hash-key", "sk-secret"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == "sha256:" + hashlib.sha256(b"sk-secret").hexdigest()
    assert cfg_with([printed]).tenants[0].api_keys == [printed.removeprefix("sha256:")]


def test_plaintext_keys_are_refused():
    with pytest.raises(ConfigError, match=r"tenants\.0\.api_keys"):
        cfg_with(["sk-secret"])


def test_bearer_key_maps_to_tenant():
    digest = hashlib.sha256(b"sk-1").hexdigest()
    auth = Authenticator(cfg_with([digest]).tenants)
    policy = auth.tenant("Bearer sk-1")
    assert (policy.name, policy.rpm, policy.kv_share) == ("a", 10, 0.5)
    for header, match in [
        (None, "didn't provide"),
        ("Basic abc", "Bearer"),
        ("Bearer ", "Bearer"),
        ("Bearer sk-2", "Incorrect"),
    ]:
        with pytest.raises(Unauthorized, match=match) as err:
            auth.tenant(header)
        assert err.value.status == 401


def test_no_tenants_means_default_tenant():
    auth = Authenticator([])
    assert not auth.enabled
    assert auth.tenant(None).name == "default"
    assert auth.tenant("Bearer whatever").name == "default"


def test_admin_gate_states():
    ops = hashlib.sha256(b"ops").hexdigest()
    tenant = cfg_with([hashlib.sha256(b"sk-1").hexdigest()])
    keyed = parse_config({"engines": [{"url": "http://127.0.0.1:9"}], "admin": {"api_keys": [ops]}})
    open_ = parse_config({"engines": [{"url": "http://127.0.0.1:9"}]})

    gate = AdminGate(keyed.admin, keyed.tenants)
    assert gate.state == "keys"
    gate.check("Bearer ops")
    for header in (None, "Bearer sk-1", "Bearer opsx", "ops"):
        with pytest.raises(Unauthorized):
            gate.check(header)

    gate = AdminGate(open_.admin, open_.tenants)
    assert gate.state == "open"
    gate.check(None)

    gate = AdminGate(tenant.admin, tenant.tenants)  # tenants, no admin keys: closed
    assert gate.state == "closed"
    with pytest.raises(Forbidden, match=r"admin\.api_keys") as err:
        gate.check("Bearer sk-1")
    assert err.value.status == 403 and err.value.code == "admin_disabled"

    gate.load(keyed.admin, tenant.tenants)  # SIGHUP with admin keys
    gate.check("Bearer ops")


def test_admin_keys_are_digests_of_their_own():
    base = {"engines": [{"url": "http://127.0.0.1:9"}]}
    with pytest.raises(ConfigError, match=r"admin\.api_keys"):
        parse_config(base | {"admin": {"api_keys": ["plaintext"]}})
    shared = hashlib.sha256(b"k").hexdigest()
    with pytest.raises(ConfigError, match="also a tenant's"):
        parse_config(
            base
            | {"tenants": [{"name": "a", "api_keys": [shared]}], "admin": {"api_keys": [shared]}}
        )


def classes_cfg(**tenant_classes):
    return parse_config(
        {
            "engines": [{"url": "http://127.0.0.1:9"}],
            "slo": {
                "classes": {"interactive": {"ttft_s": 1, "tpot_s": 0.05}, "batch": {}},
                "default_class": "batch",
            },
            "tenants": [
                {"name": "a", "api_keys": [hashlib.sha256(b"sk-a").hexdigest()], **tenant_classes}
            ],
        }
    )


def test_a_tenants_policy_carries_its_classes():
    interactive, batch = ServiceClass("interactive", 1.0, 0.05), ServiceClass("batch")
    cfg = classes_cfg(service_class="interactive", service_classes=["batch", "interactive"])
    policy = Authenticator(cfg.tenants, cfg.slo).tenant("Bearer sk-a")
    assert policy.service_class == interactive
    assert policy.service_classes == (interactive, batch)  # its own first, once
    # A tenant that names none has slo.default_class, and may name only that.
    cfg = classes_cfg()
    policy = policy_of(cfg.tenants[0], cfg.slo)
    assert (policy.service_class, policy.service_classes) == (batch, (batch,))


def test_the_class_a_request_names_is_one_its_tenant_may_use():
    cfg = classes_cfg(service_class="interactive")
    auth = Authenticator(cfg.tenants, cfg.slo)
    tenant = auth.tenant("Bearer sk-a")
    assert auth.class_header == b"x-kv-gateway-service-class"
    assert auth.service_class(tenant, None) == tenant.service_class  # named none: its own
    assert auth.service_class(tenant, "interactive") == tenant.service_class
    for named in ("batch", "gold", "", "x" * 500):  # batch exists, but is not a's
        with pytest.raises(BadRequest) as err:
            auth.service_class(tenant, named)
        assert err.value.status == 400 and err.value.code == "invalid_service_class"
        assert err.value.type == "invalid_request_error"
        assert "it may use: interactive." in err.value.message
        assert len(err.value.message) < 300  # a long header is not echoed whole


def test_without_tenants_the_default_tenant_may_name_any_class():
    cfg = classes_cfg()
    auth = Authenticator([], cfg.slo)
    tenant = auth.tenant(None)
    assert tenant.name == "default" and tenant.service_class == ServiceClass("batch")
    assert auth.service_class(tenant, "interactive") == ServiceClass("interactive", 1.0, 0.05)
    # And with no classes at all, it has none and may name none.
    bare = Authenticator([])
    assert bare.tenant(None) == TenantPolicy()
    with pytest.raises(BadRequest, match="it may use: none"):
        bare.service_class(bare.tenant(None), "batch")


def test_a_reload_takes_the_new_classes():
    cfg = classes_cfg(service_class="interactive")
    auth = Authenticator(cfg.tenants, cfg.slo)
    moved = classes_cfg(service_classes=["interactive"])
    slo = moved.slo.model_copy(update={"header": "x-class"})
    auth.load(moved.tenants, slo)
    tenant = auth.tenant("Bearer sk-a")
    assert tenant.service_class == ServiceClass("batch")
    assert auth.service_class(tenant, "interactive") == ServiceClass("interactive", 1.0, 0.05)
    assert auth.class_header == b"x-class"
