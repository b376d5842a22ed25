"""What ``import keyop_messenger`` and an idle messenger load (idle memory, docs/performance.md).

A publisher on a small board imports the package, builds a configuration, starts a
messenger (local, or a client with two hubs) and publishes; none of that needs the
modules in ``DEFERRED``, each of which costs resident memory (docs/performance.md,
"Small boards"). A child process does exactly that and reports which of them got
imported: an eager import of any of them, added anywhere on that path, fails here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import keyop_messenger as km

CHILD_TIMEOUT_S = 60

#: Modules the idle path must not import, with where each is imported instead.
DEFERRED = {
    "difflib": "did-you-mean hints of unknown configuration keys",
    "fractions": "no longer used (durations are parsed with integers)",
    "decimal": "payload decoders (_typed), on the first register()",
    "uuid": "payload decoders (_typed), on the first register()",
    "socket": "the default name (host name), only when name is left out",
    "yaml": "load_config of a YAML file",
    "asyncio": "keyop_messenger.aio (AsyncMessenger, ...)",
    "ssl": "asyncio",
    "http.server": "the metrics endpoint",
    "pyspark": "keyop_messenger.spark",
    "pyarrow": "keyop_messenger.spark",
    "keyop_messenger._typed": "PayloadRegistry.register",
    "keyop_messenger.stats": "Messenger.stats() / federation_status(), km.Stats, ...",
    "keyop_messenger.metrics": "a messenger with metrics.listen_addr",
    "keyop_messenger._prometheus": "keyop_messenger.metrics",
    "keyop_messenger.health": "keyop_messenger.metrics",
    "keyop_messenger._metrics_http": "MetricsServer.start",
    "keyop_messenger.ephemeral": "km.EphemeralMessenger",
    "keyop_messenger.aio": "km.AsyncMessenger, ...",
    "keyop_messenger.spark": "import keyop_messenger.spark",
    "keyop_messenger.cli": "the keyop-messenger command",
    "keyop_messenger.bench": "keyop-messenger bench",
    "keyop_messenger.config.checks": "keyop-messenger run / check",
    "keyop_messenger.config.overrides": "keyop-messenger run --set",
}

# Prints, as JSON, which of the modules named in argv[2] were imported by the
# package (those already loaded before it, by the environment, are left out).
CHILD = """
import json, sys
from pathlib import Path
before = set(sys.modules)
import keyop_messenger as km
from keyop_messenger import _core

root, names = Path(sys.argv[1]), json.loads(sys.argv[2])
_core.keygen_ca(root / "ca.crt", root / "ca.key")
_core.keygen_instance(root / "ca.crt", root / "ca.key", "fp", root / "fp.crt",
                      root / "fp.key", sans=["127.0.0.1"])
tls = {"cert": str(root / "fp.crt"), "key": str(root / "fp.key"), "ca": str(root / "ca.crt")}
client = {"enabled": True, "hubs": [{"addr": "127.0.0.1:9", "publish": ["a"]},
                                    {"addr": "127.0.0.1:9", "publish": ["b"]}]}
for doc in ({"name": "fp", "storage": {"data_dir": str(root / "local")}},
            {"name": "fp", "storage": {"data_dir": str(root / "client")}, "tls": tls,
             "client": client}):
    m = km.Messenger(km.Config.from_dict(doc))
    m.publish("a", "t", {"n": 1})
    m.close()
print(json.dumps(sorted(n for n in names if n in sys.modules and n not in before)))
"""


def test_idle_messenger_does_not_import_deferred_modules(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path), json.dumps(sorted(DEFERRED))],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    imported = json.loads(done.stdout.strip().splitlines()[-1])
    assert imported == [], "imported on the idle path, defer them again: " + ", ".join(
        f"{name} (belongs to {DEFERRED[name]})" for name in imported
    )


def test_lazy_public_names_resolve() -> None:
    from keyop_messenger import EphemeralMessenger, Stats
    from keyop_messenger.ephemeral import EphemeralMessenger as Ephemeral
    from keyop_messenger.stats import Stats as StatsClass

    assert EphemeralMessenger is Ephemeral and Stats is StatsClass
    for name in km.__all__:
        assert getattr(km, name) is not None, name
    assert set(km.__all__) <= set(dir(km))
