"""What a gateway remembers per events engine is bounded by its config (soak review of 2026-11-29, /tmp/s36/soak
finding 3): the KV-event subscriber's engine-hash -> chain-hash map (``max_mapped_blocks``) and the residency
tracker's unattributed and removed-block memories (``max_unattributed_blocks``, ``max_known_blocks``). Before,
none of the three could be set, so a gateway grew to their fixed powers of two per engine whatever the engines
held."""

from __future__ import annotations

import pytest

from quillcache.gateway import app as appmod
from quillcache.gateway.config import ConfigError, config_from_dict
from quillcache.gateway.tenants import TenantKey, TenantTable

ENGINES = [{"url": "http://127.0.0.1:9", "name": "e0", "kv_events": "tcp://127.0.0.1:9",
            "kv_events_replay": "tcp://127.0.0.1:10"}]


def test_the_caps_reach_the_tracker_and_the_subscriber(monkeypatch):
    made = []

    class Recorder:
        def __init__(self, *args, **kwargs):
            made.append(kwargs)

        def start(self):
            pass

    monkeypatch.setattr("quillcache.kvevents.KvEventSubscriber", Recorder)
    cfg = config_from_dict({"engines": ENGINES, "max_mapped_blocks": 5000, "max_unattributed_blocks": 700,
                            "max_known_blocks": 0})
    gw = appmod.Gateway(cfg, TenantTable({"sk-units-0001": TenantKey(tenant="t")}))
    assert (gw.tracker.max_unattributed_blocks, gw.tracker.max_known_blocks) == (700, 0)
    gw._subscribe(cfg.engines[0], loop=None)
    assert made and made[0]["max_mapped_blocks"] == 5000


@pytest.mark.parametrize("field, value, message", [
    ("max_mapped_blocks", 0, "max_mapped_blocks=0 must be >= 1"),
    ("max_unattributed_blocks", -1, "max_unattributed_blocks=-1 must be >= 0"),
    ("max_known_blocks", "many", "max_known_blocks must be an integer"),
])
def test_bad_caps_are_refused_naming_the_field(field, value, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"engines": ENGINES, field: value})
