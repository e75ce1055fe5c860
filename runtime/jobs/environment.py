"""The environment a task's run gets, resolved as its options say: here, or on two other hosts.

    env = resolved_env(gpu="MI300X", site=None, config="configs/x.yaml", env=["NCCL_DEBUG=INFO"])
    print_warnings(env.warnings)
    a, b, env_a, env_b = resolve_on_hosts(c, "node1,node2")     # env.diff --hosts
    var = explained_var(env, "nccl_socket_ifname")               # env.explain: any case, else UserError
    write_export(env, "anvil.env", force=False)                  # env.export -o: never over a file not its own

Bad input (an unknown GPU or site, a malformed KEY=VALUE, an unreadable config)
raises envs.EnvError, a UserError: the inv program shows its message, exit 2.
"""
from __future__ import annotations

import difflib
import sys
from pathlib import Path

from core.errors import AnvilError, UserError


def resolved_env(gpu=None, site=None, config=None, env=None, tune_gemm=False):
    import envs

    config_env = envs.load_config_env(config) if config else None
    return envs.resolve(gpu=gpu or None, site=site or None, config_env=config_env, overrides=env or (),
                        config_ref=f"{config} (env:)" if config else "the training config's env: block",
                        tune_gemm=tune_gemm)


def profile_setters() -> dict[str, list[str]]:
    """{variable: [labels of every profile layer that sets it]}, over all GPU models and sites."""
    from envs import profiles
    from envs.profiles import sites, tunableop

    stack = [profiles.BASE, *profiles.VENDOR_PROFILES.values(), *profiles.MODEL_PROFILES.values(),
             *(module.PROFILE for module in sites.SITES.values()), tunableop.PROFILE]
    setters: dict[str, list[str]] = {}
    for profile in stack:
        for entry in profile.entries:
            setters.setdefault(entry.name, []).append(profile.label)
    return setters


def explained_var(resolved, name: str):
    """The Var `name` names in `resolved`, matched in any case (nccl_socket_ifname); else a UserError
    saying which layers would set it, or the closest names any layer knows."""
    if name in resolved.vars:
        return resolved.vars[name]
    same = [known for known in resolved.vars if known.upper() == name.upper()]
    if len(same) == 1:
        return resolved.vars[same[0]]
    if same:
        raise UserError(f"{name} matches {', '.join(sorted(same))}: give the exact name")
    here = f"no layer sets {name} for {resolved.machine.summary()} (layers: {' -> '.join(resolved.layers)})"
    setters = profile_setters()
    elsewhere = [known for known in setters if known.upper() == name.upper()]
    if elsewhere:
        where = setters[elsewhere[0]]
        flags = [flag for prefixes, flag in ((("vendor:", "model:"), "--gpu MODEL"), (("site:",), "--site SITE"),
                                             (("tuning:",), "--tune-gemm"))
                 if any(w.startswith(prefixes) for w in where)]
        raise UserError(f"{here}; {elsewhere[0]} is set by {', '.join(where)}"
                        + (f": see it with {' or '.join(flags)}" if flags else ""))
    known = sorted(set(setters) | set(resolved.vars))
    close = difflib.get_close_matches(name.upper(), known, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(close)}?" if close else "no Anvil profile knows that name"
    raise UserError(f"{here}; {hint} (inv env.show lists what is set)")


def write_export(resolved, output: str, force: bool = False) -> None:
    """The shell file of `resolved` at `output`, atomically; a UserError (one line) for a path it
    cannot write, or a file there that env.export did not write, unless `force`."""
    import envs
    from envs.export import MARK
    from core.files import refuse_foreign, write_atomic

    refuse_foreign(output, UserError, (MARK,), "a file env.export wrote", force=force, option="--output")
    if Path(output).is_dir():
        raise UserError(f"--output {output} is a directory; expected a file path such as {Path(output) / 'anvil.env'}")
    try:
        write_atomic(output, envs.shell_script(resolved))
    except OSError as exc:
        raise UserError(f"cannot write {output}: {exc.strerror or exc}") from None


def print_warnings(warnings) -> None:
    for warning in warnings:
        print(f"WARNING: {warning}", file=sys.stderr)


def resolve_on_hosts(c, hosts: str):
    """(name_a, name_b, env_a, env_b): each host resolves its own (`inv env.show --json` over SSH)."""
    from envs.resolve import ResolvedEnv
    from runtime import settings as settings_mod
    from runtime.cluster import Runtime

    names = [h.strip() for h in hosts.split(",") if h.strip()]
    if len(names) != 2:
        raise UserError("--hosts takes exactly two hosts: --hosts a,b")
    settings = settings_mod.load(c)
    transport = Runtime("ssh").open(settings.cluster_options(hosts=names))
    results = dict(zip(names, transport.each_node([transport.inv(), "env.show", "--json"])))
    resolved = []
    for name in names:
        outcome = results[name]
        if not outcome.ok or not isinstance(outcome.payload, dict):
            why = outcome.error or (outcome.stderr.strip().splitlines() or [f"exit status {outcome.exit_code}"])[-1]
            raise AnvilError(f"{name}: {why}", 1)
        resolved.append(ResolvedEnv.from_json(outcome.payload))
    return names[0], names[1], resolved[0], resolved[1]
