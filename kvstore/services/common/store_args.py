"""The store's command-line flags: one argparse group, spelled the same in every CLI.

``kvstore serve`` and ``kvstore engine`` both call ``add_store_arguments``; each flag is one
StoreSettings field (``STORE_FLAGS``), so the flag, the TOML key (the field name) and the
python keyword name one knob. A service that decides a knob itself leaves its flag out
(``without``) and says so in the group's description.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvstore.codecs import AUTO, CODECS
from kvstore.config import COLD_BLOCKS, PROMOTIONS, REMOTE_WRITES, WRITE_POLICIES, StoreSettings
from kvstore.errors import ConfigError
from kvstore.keys import HASHES
from kvstore.policy.admission import ADMISSIONS
from kvstore.services.common.argtypes import positive
from kvstore.services.common.sizes import format_size, parse_size

GROUP_TITLE = "store tiers"
CODEC_HELP = "how {tier} stores blocks: none (the bytes put) or a lossy codec; int8 keeps about half the bytes"


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _remote_url(text: str) -> str:
    """Checked here so that the usage error names the flag; its message never shows a password."""
    from kvstore.tiers.remote.url import parse_url

    try:
        parse_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


@dataclass(frozen=True)
class StoreFlag:
    """One flag of the group: its spelling, its value's form and what it sets."""

    flag: str
    help: str
    metavar: str | None = None
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None


STORE_FLAGS: dict[str, StoreFlag] = {  # StoreSettings field -> its flag
    "host_bytes": StoreFlag("--host-mem", "host RAM tier size, e.g. 512MiB", "SIZE", _size),
    "disk_path": StoreFlag("--disk-path", "disk tier directory", "DIR"),
    "disk_bytes": StoreFlag("--disk-size", "disk tier size, e.g. 20GiB", "SIZE", _size),
    "write_policy": StoreFlag("--write-policy", "write_through: a put is on disk before it returns; "
                              "write_back: host evictions demote to disk", choices=WRITE_POLICIES),
    "disk_admission": StoreFlag("--disk-admission", "which of host RAM's demoted blocks the disk takes: all, "
                                "those seen_twice, or tinylfu (recent access count beats the disk's next victim's)",
                                choices=ADMISSIONS),
    "remote_admission": StoreFlag("--remote-admission", "which blocks are sent to the remote tier: all, those "
                                  "seen_twice, or tinylfu (met at least twice by the access sketch)",
                                  choices=ADMISSIONS),
    "promotion": StoreFlag("--promotion", "when a disk or remote block is copied up to host RAM: on get, "
                           "ahead of time on lookup, or never", choices=PROMOTIONS),
    "host_codec": StoreFlag("--host-codec", CODEC_HELP.format(tier="host RAM"), choices=tuple(CODECS)),
    "disk_codec": StoreFlag("--disk-codec", CODEC_HELP.format(tier="the disk tier") + "; auto: int8 where a "
                            "cold read of int8 blocks measures faster on this disk, else none (measured once per "
                            "directory, kept in its codec-choice.json)", choices=(*CODECS, AUTO)),
    "remote_codec": StoreFlag("--remote-codec", CODEC_HELP.format(tier="the remote tier"), choices=tuple(CODECS)),
    "remote_url": StoreFlag("--remote-url", "a remote tier shared with other nodes: "
                            "redis+cluster://HOST:PORT[,HOST:PORT...] or redis://HOST:PORT (docs/remote.md); "
                            "a password in it shows in ps", "URL", _remote_url),
    "remote_writes": StoreFlag("--remote-writes", "which blocks go remote: every put, or only those that "
                               "demote out of the local tiers", choices=REMOTE_WRITES),
    "remote_timeout_s": StoreFlag("--remote-timeout", "the remote tier's socket timeout and per-call deadline",
                                  "SECONDS", positive(float)),
    "remote_queue_blocks": StoreFlag("--remote-queue-blocks", "the remote write-behind queue bound; "
                                     "blocks beyond it are dropped", "N", positive(int)),
    "remote_prefix": StoreFlag("--remote-prefix", "first part of every remote key name, "
                               "one per deployment sharing a cluster", "PREFIX"),
    "hash_algo": StoreFlag("--hash-algo", "the key hash; xxh3_128 is faster but not collision-resistant: "
                           "one tenant only", choices=tuple(HASHES)),
    "cold_blocks": StoreFlag("--cold-blocks", "a sliding-window block below every used window, when host RAM "
                             "evicts it: drop it (default) or demote it like any block", choices=COLD_BLOCKS),
}
assert set(STORE_FLAGS) == set(StoreSettings.names()), "every store setting has one flag"


def add_store_arguments(parser: argparse.ArgumentParser, *, defaults: StoreSettings,
                        without: Collection[str] = (), shown: Mapping[str, str] | None = None,
                        description: str | None = None) -> argparse._ArgumentGroup:
    """Add the store flags to ``parser`` as one group titled GROUP_TITLE.

    Every flag defaults to None (not given), so that ``store_settings_from_args`` overrides a
    base (a TOML file, the service's defaults) only with what was typed; the help shows
    ``defaults``' value, or ``shown``'s text where a default is computed (a tenth of RAM).

    Args:
        defaults: the service's store defaults, as shown in the help.
        without: settings the service decides itself: no flag (say why in ``description``).
        shown: the default's text per setting, where it is not ``defaults``' value.
        description: the group's text in ``--help``.
    """
    unknown = sorted(set(without) - set(STORE_FLAGS))
    assert not unknown, f"not store settings: {unknown}"
    group = parser.add_argument_group(GROUP_TITLE, description)
    for name, spec in STORE_FLAGS.items():
        if name in without:
            continue
        default = (shown or {}).get(name)
        if default is None:
            value = getattr(defaults, name)
            default = "none" if value is None else format_size(value) if name in ("host_bytes", "disk_bytes") \
                else str(value)
        kwargs: dict[str, Any] = {"dest": name, "default": None, "help": f"{spec.help} (default {default})"}
        if spec.choices is not None:
            kwargs["choices"] = list(spec.choices)
        else:
            kwargs.update(metavar=spec.metavar, type=spec.type)
        group.add_argument(spec.flag, **kwargs)
    return group


def store_flags_given(args: argparse.Namespace) -> dict[str, Any]:
    """The store settings given on the command line, by field name (their values parsed)."""
    return {name: getattr(args, name) for name in STORE_FLAGS if getattr(args, name, None) is not None}


def store_settings_from_args(args: argparse.Namespace, base: StoreSettings) -> StoreSettings:
    """``base`` with the store flags given on the command line applied over it.

    Raises:
        ConfigError: the result is not valid settings (e.g. a lossy host codec over a raw disk).
    """
    return replace(base, **store_flags_given(args))


def flag_of(name: str) -> str:
    """The command-line spelling of store setting ``name`` (``remote_url`` -> ``--remote-url``)."""
    return STORE_FLAGS[name].flag
