"""The `inv` program: Invoke's task runner with Fabric's host flags and real fan-out.

A "superset" program (Invoke's Program subclassed with no bundled
namespace, as Fabric's own `fab` is), so it discovers tasks.py and reads invoke.yaml / INVOKE_* / -f
exactly as stock Invoke does, plus Fabric's -H/-i/-S/-t and the project's
runner settings under `anvil:`. Differences from stock Invoke/Fabric, each
for a reason:

- Fabric is imported only when -H is used: importing paramiko costs ~0.25 s,
  half of the 0.5 s budget for `inv --list`. The flags are Fab's own.
- `-H a,b TASK` runs TASK on all hosts at once (runtime.jobs.fanout), the remote
  side running the same `inv` with the task's pre/post tasks, instead of
  Fabric's serial, stop-at-first-failure loop with pre/post run locally once.
  `-H @` means the hosts in `anvil.hosts`.
- No task option can hide -h/-H: auto short flags that would take them are
  dropped (the long option still works).
- `--config FILE` after a task lacking a `config` option is an error, not a
  silently loaded Invoke runtime config (Invoke reads `--config` as its core -f flag). `-f FILE` before the task
  name loads one as usual.
- No tasks.py above the current directory: the Anvil checkout's own is used,
  so `anvil ...` works from anywhere.
- `inv` alone lists the tasks. Invoke's options for commands run through
  c.run() (--dry, --echo, --pty, ...: INERT_CORE) would do nothing here, so
  they are hidden from --help and refused; `-H ''` is refused, not run here.
- What follows `--` reaches a task word for word (settings.program_args: train.launch's
  program), where Invoke keeps only the words joined by spaces.
- Every YAML file Invoke reads for us goes through core.safe_yaml, and the
  settings' types are checked (-f before Invoke merges it, INVOKE_ANVIL_*
  before a task runs): one line, exit 2, never a traceback.

The script-name clash with Invoke's own `inv` (pip reinstalling invoke
rewrites bin/inv): see runtime/program/shim.py; `main()` keeps that shim in place.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from pathlib import Path

from invoke import Argument, Config, Executor, Program
from invoke import __version__ as invoke_version
from invoke.config import AmbiguousMergeError
from invoke.exceptions import Exit

from runtime import settings as settings_mod
from core.errors import AnvilError, UserError

VERSION = "0.1.0"
SHORT_FLAGS_KEPT = ("h", "H")   # core flags no task's auto short flag may take
# Invoke's core options for shell commands run through c.run(): Anvil's tasks run none, so these would
# do nothing. They are hidden from --help and refused, so that `inv --dry TASK` never runs TASK for real.
INERT_CORE = {"dry": "-R/--dry", "echo": "-e/--echo", "pty": "-p/--pty", "hide": "--hide",
              "warn-only": "-w/--warn-only", "command-timeout": "-T/--command-timeout",
              "prompt-for-sudo-password": "--prompt-for-sudo-password"}


class AnvilConfig(Config):
    # invoke.yaml / INVOKE_* like stock Invoke.
    prefix = "invoke"
    file_prefix = "invoke"
    env_prefix = "INVOKE"

    @staticmethod
    def global_defaults():
        defaults = Config.global_defaults()
        defaults["tasks"]["collection_name"] = "tasks"
        # Declared so INVOKE_ANVIL_* env vars can override them (Invoke only lets the
        # environment override keys that already exist).
        defaults["anvil"] = dict(settings_mod.DEFAULTS)
        return defaults

    def _load_yaml(self, path):
        # Every YAML file Invoke reads for us (invoke.yaml, ~/.invoke.yaml, -f FILE): data of bounded size.
        from core import safe_yaml
        with open(path, "rb") as handle:
            return safe_yaml.load(handle.read())

    _load_yml = _load_yaml


class AnvilExecutor(Executor):
    """Plain Invoke execution locally; all-hosts-at-once fan-out under -H.

    The one place where Anvil's errors become Invoke's Exit: an AnvilError
    raised by any layer below a task ends as its message (prefixed with the
    task's name) and its exit code, never as a traceback.
    """

    current_task = ""

    def expand_calls(self, calls):
        expanded = super().expand_calls(calls)
        for call in expanded:
            make_context = call.make_context

            def named(config, _call=call, _make=make_context):
                self.current_task = _call.called_as or _call.task.name
                return _make(config)
            call.make_context = named
        return expanded

    def execute(self, *tasks):
        try:
            return self._execute(*tasks)
        except AnvilError as exc:
            message = str(exc) or type(exc).__name__
            name = self.current_task
            if name and not message.startswith(name):
                message = f"{name}: {message}"
            raise Exit(message, exc.exit_code) from None

    def _execute(self, *tasks):
        # Invoke reads INVOKE_* variables into the config only as it runs each call; the
        # fan-outs below decide before any call (INVOKE_ANVIL_RUNTIME=slurm, _RUNS_DIR, ...).
        self.config.load_collection(self.collection.configuration())
        _check_numeric_variables()
        with _config_errors("INVOKE_ANVIL_* variables"):
            self.config.load_shell_env()
            settings_mod.load(self)   # each setting's value, before any task meets it
        hosts = self.core[0].args.hosts.value if self.core is not None else None
        if hosts is not None and not hosts.strip():   # -H '' is a mistake, not "run it here"
            raise Exit("-H is empty: name the hosts (-H node1,node2, or -H @ for anvil.hosts); leave -H out "
                       "to run here", 2)
        config_file = self.core[0].args.config.value if self.core is not None else None
        if self.core is not None:   # -i, -S, -t, the prompts: for whatever reaches hosts over SSH
            self.config[settings_mod.SSH_FLAGS] = self._ssh_flags()
        fanned = [None if hosts else self._on_nodes(t) for t in tasks]
        if not hosts and not any(fanned):
            return super().execute(*tasks)
        from runtime.jobs import fanout
        results = {}
        for context, runtime in zip(tasks, fanned):   # in order, stopping at the first that fails (like Invoke)
            self.current_task = context.name
            if hosts and not self._takes_hosts(context, hosts):
                code = fanout.over_hosts(self.config, context, hosts, config_file)
            elif runtime is not None:        # a per-node task under a runtime that spans nodes
                code = fanout.on_nodes(self.config, context, runtime, config_file)
            else:
                results.update(super().execute(context))
                continue
            if code:
                raise Exit(code=code)
        return results

    def _made_with(self, context, flag: str) -> bool:
        """Whether the task to run was made with run_task(flag=True) (per_node, takes_hosts)."""
        try:
            task = self.collection[context.name]
        except (KeyError, TypeError):
            return False
        return bool(getattr(task, flag, False))

    def _ssh_flags(self):
        """inv's SSH flags (-i, -S, -t, the prompts) over the settings' SSH options: what every SSH
        session of this inv uses (settings.Settings.ssh_options)."""
        import os

        settings = settings_mod.load(self)
        args = self.core[0].args
        keys = list(settings.key_filename) + [os.path.expanduser(k) for k in (args.identity.value or [])]
        password = passphrase = None
        if args["prompt-for-login-password"].value:
            import getpass
            password = getpass.getpass("Enter login password for use with SSH auth: ")
        if args["prompt-for-passphrase"].value:
            import getpass
            passphrase = getpass.getpass("Enter passphrase for use unlocking SSH keys: ")
        return dataclasses.replace(settings.ssh_options(), key_filename=keys, ssh_config=args["ssh-config"].value,
                                   connect_timeout=float(args["connect-timeout"].value or settings.connect_timeout),
                                   password=password, passphrase=passphrase)

    def _takes_hosts(self, context, hosts: str) -> bool:
        """A task that reaches the nodes itself (run_task(takes_hosts=True): preflight.comm,
        train.pretrain): under -H it runs once, here, with -H's hosts as its --hosts."""
        if not self._made_with(context, "takes_hosts"):
            return False
        given = context.args["hosts"].value
        if given and given != hosts:
            raise Exit(f"{context.name}: -H {hosts} and --hosts {given}: name the hosts once", 2)
        context.args["hosts"].value = hosts
        return True

    def _on_nodes(self, context):
        """The runtime a per-node task (run_task(per_node=True)) fans out over, when it spans nodes
        (slurm: the allocation's; ssh: anvil.hosts); None to run it here."""
        if not self._made_with(context, "per_node"):
            return None
        from runtime.jobs.fanout import per_node_options
        from runtime.runs.options import per_node_runtime
        given, nodes = per_node_options(context)
        try:
            runtime, note = per_node_runtime(given, settings_mod.load(self).runtime)
        except UserError as exc:
            raise Exit(f"{context.name}: {exc}", exc.exit_code) from None
        if note:
            print(f"{context.name}: {note}", file=sys.stderr, flush=True)
        if nodes and not runtime.scheduler:
            raise Exit(f"{context.name}: --nodes needs --runtime slurm (runtime is {runtime})", 2)
        return runtime if runtime.spans_nodes else None


class AnvilProgram(Program):
    def print_version(self):
        super().print_version()
        print(f"Invoke {invoke_version}")

    def core_args(self):
        # Fabric's flags (fabric/main.py Fab.core_args), without importing fabric.
        return super().core_args() + [
            Argument(names=("H", "hosts"),
                     help="Comma-separated host name(s) to run the task on, all at once "
                          "('@' = anvil.hosts)."),
            Argument(names=("i", "identity"), kind=list,
                     help="Path to runtime SSH identity (key) file. May be given multiple times."),
            Argument(names=("prompt-for-login-password",), kind=bool,
                     help="Request an upfront SSH-auth password prompt."),
            Argument(names=("prompt-for-passphrase",), kind=bool,
                     help="Request an upfront SSH key passphrase prompt."),
            Argument(names=("S", "ssh-config"), help="Path to runtime SSH config file."),
            Argument(names=("t", "connect-timeout"), kind=int,
                     help="Specifies default connection timeout, in seconds."),
        ]

    def print_help(self):
        """Core help without the options that do nothing in Anvil (INERT_CORE)."""
        hidden = {flag for name in INERT_CORE for flag in self.initial_context.flags
                  if self.initial_context.flags[flag].name == name}
        tuples = [t for t in self.initial_context.help_tuples()
                  if not any(part.split("=")[0].split("[")[0] in hidden for part in t[0].split(", "))]
        print(f"Usage: {self.binary} [--core-opts] task1 [--task1-opts] ... taskN [--taskN-opts]\n")
        print("Core options:\n")
        self.print_columns(tuples)

    def no_tasks_given(self):
        """`inv` alone lists the tasks (Invoke prints its core help)."""
        self.list_tasks()
        print(f"`{self.binary} --help TASK` shows a task's options; `{self.binary} --help` the core options.")
        raise Exit

    def _refuse_inert_core_options(self) -> None:
        given = [flag for name, flag in INERT_CORE.items() if self.core[0].args[name].got_value]
        if given:
            raise Exit(f"{', '.join(given)}: Invoke's option(s) for shell commands run through Invoke; Anvil's "
                       "tasks run none, so it would do nothing. A task that can show what it would run "
                       "takes --dry-run (`inv --help TASK`).", 2)

    def create_config(self):
        with _config_errors():
            super().create_config()

    def update_config(self, merge: bool = True):
        runtime_file = self.args.config.value
        if runtime_file:
            _check_runtime_file(Path(runtime_file))
        with _config_errors(f"invoke.yaml or -f {runtime_file}" if runtime_file else "invoke.yaml"):
            super().update_config(merge=merge)
            # Check the runner settings once, here, so no task meets a bad one as a traceback.
            settings_mod.load(self)
        # What follows `--`, word for word (train.launch's program): Invoke keeps it joined by spaces only.
        argv = list(self.argv or [])
        self.config[settings_mod.PROGRAM_ARGS] = argv[argv.index("--") + 1:] if "--" in argv else []

    def load_collection(self):
        with _config_errors():
            self._load_collection()

    def _load_collection(self):
        try:
            super().load_collection()
        except Exit:
            explicit = self.args["search-root"].value or self.args.collection.value
            if explicit or not (settings_mod.CHECKOUT / "tasks.py").is_file():
                raise
            # No tasks.py above cwd: use the checkout this program lives in.
            self.args["search-root"].value = str(settings_mod.CHECKOUT)
            super().load_collection()

    def _make_parser(self):
        parser = super()._make_parser()
        for context in parser.contexts.values():
            _drop_shadowing_short_flags(context)
        return parser

    def parse_tasks(self):
        from invoke.exceptions import ParseError
        self._task_help_anywhere()
        try:
            super().parse_tasks()
        except ValueError as exc:
            # Invoke casts typed options (int) while parsing and lets the ValueError out.
            raise Exit(_bad_value_message(self.core.unparsed, exc), 2) from None
        except ParseError as exc:
            # A missing or unknown option is a user error (exit 2), as everywhere else in inv.
            raise Exit(str(exc) + self._did_you_mean(str(exc)), 2) from None
        self._refuse_inert_core_options()
        swallowed = self.core_via_tasks.args["config"].got_value
        if swallowed and any(t == "--config" or t.startswith("--config=") for t in self.core.unparsed):
            names = ", ".join(t.name for t in self.tasks) or "this task"
            raise Exit(f"{names} has no --config option, so Invoke would read the file as its own "
                       f"runtime configuration. Put `-f FILE` before the task name if that is what "
                       f"you want; see `{self.binary} --help {self.tasks[0].name if self.tasks else 'TASK'}` "
                       f"for the task's options.", 2)


    def _did_you_mean(self, message: str) -> str:
        """" (did you mean train.pretrain?)" for Invoke's "No idea what 'train.pretrian' is!"."""
        import difflib
        import re
        unknown = re.fullmatch(r"No idea what '(.+)' is!", message)
        if not unknown or unknown[1].startswith("-"):
            return ""
        names = [n for primary, aliases in self.collection.task_names.items() for n in (primary, *aliases)]
        close = difflib.get_close_matches(unknown[1], names, n=3, cutoff=0.6)
        return f" (did you mean {' or '.join(close)}?)" if close else f" (`{self.binary} --list` lists the tasks)"

    def _task_help_anywhere(self) -> None:
        """`inv TASK --help` (or -h) anywhere after the task name shows the task's help, as
        `inv --help TASK` does. Stock Invoke takes it for the value of a positional argument
        still waiting (`inv snapshot.show --help`: "no such run directory: --help")."""
        tokens = list(self.core.unparsed)
        names = {name for primary, aliases in self.collection.task_names.items() for name in (primary, *aliases)}
        if tokens and tokens[0] in names and any(t in ("--help", "-h") for t in tokens[1:]):
            self.args.help.value = tokens[0]
            self.core.unparsed = []


def _bad_value_message(tokens: list[str], exc: ValueError) -> str:
    """`-M abc` -> "-M: expected an integer, got 'abc'" (the flag found by its value); a float
    option (int() and float() word their errors differently) expects a number."""
    text = str(exc)
    value = text.rsplit(": ", 1)[-1].strip("'\"") if ": " in text else ""
    expected = "a number" if "float" in text else "an integer"
    for i, token in enumerate(tokens):
        if token.startswith("-") and "=" in token and token.split("=", 1)[1] == value:
            return f"{token.split('=', 1)[0]}: expected {expected}, got {value!r}"
        if token == value and i and tokens[i - 1].startswith("-"):
            return f"{tokens[i - 1]}: expected {expected}, got {value!r}"
    return f"bad option value: {text}"


@contextlib.contextmanager
def _config_errors(settings_from: str = "invoke.yaml"):
    """Broken invoke.yaml / -f file / bad anvil setting: one message, exit 2, no traceback."""
    import yaml   # PyYAML: AnvilConfig reads YAML with it (core.safe_yaml)
    from invoke.util import yaml as invoke_yaml
    try:
        yield
    except (yaml.YAMLError, invoke_yaml.YAMLError) as exc:
        raise Exit(f"invalid YAML in a configuration file: {exc}", 2) from None
    except json.JSONDecodeError as exc:
        raise Exit(f"invalid JSON in a configuration file: {exc}", 2) from None
    except UserError as exc:            # SettingsError, or the runtime (runtime.cluster.BadRuntime)
        raise Exit(f"{settings_from}: {exc}", 2) from None
    except AmbiguousMergeError as exc:  # a mapping where a setting is a value, or the other way round
        raise Exit(f"{settings_from}: a setting has the wrong type: {exc}", 2) from None
    except OSError as exc:
        raise Exit(f"cannot read a configuration file: {exc}", 2) from None


def _check_runtime_file(path: Path) -> None:
    """-f FILE as Invoke will merge it: a readable YAML/JSON mapping whose `anvil` (if any) is a mapping
    of settings of the right types. Invoke itself skips a missing file silently and meets the others
    with a traceback."""
    import yaml   # PyYAML, which core.safe_yaml reads with (not Invoke's vendored copy)
    from core import safe_yaml
    if path.is_dir():
        raise Exit(f"-f {path}: is a directory; expected a YAML or JSON configuration file", 2)
    if not path.is_file():
        raise Exit(f"-f {path}: no such configuration file", 2)
    try:
        text = path.read_bytes().decode("utf-8")
        data = json.loads(text) if path.suffix == ".json" else safe_yaml.load(text)
    except OSError as exc:
        raise Exit(f"-f {path}: cannot read it ({exc.strerror or exc})", 2) from None
    except UnicodeDecodeError as exc:
        raise Exit(f"-f {path}: not a text file (invalid UTF-8 at byte {exc.start}); expected YAML or JSON",
                   2) from None
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise Exit(f"-f {path}: invalid {'JSON' if path.suffix == '.json' else 'YAML'}: {exc}", 2) from None
    if data is not None and not isinstance(data, dict):
        raise Exit(f"-f {path}: expected a mapping of settings (e.g. 'anvil:' with keys under it), got a "
                   f"{type(data).__name__}", 2)
    section = (data or {}).get("anvil", {})
    if not isinstance(section, dict):
        raise Exit(f"-f {path}: 'anvil' must be a mapping of settings (runs_dir, hosts, runtime, ...), got "
                   f"{'nothing' if section is None else type(section).__name__}", 2)
    try:   # each setting's type, before Invoke merges it over the defaults (a mapping over a string: a traceback)
        settings_mod.from_mapping(section, Path("."))
    except UserError as exc:
        raise Exit(f"-f {path}: {exc}", 2) from None


def _check_numeric_variables() -> None:
    """INVOKE_ANVIL_<KEY> for a numeric setting: Invoke casts it with int() as it loads the
    environment, and a word is a ValueError traceback there."""
    import os
    for key, default in settings_mod.DEFAULTS.items():
        name = f"INVOKE_ANVIL_{key.upper()}"
        value = os.environ.get(name)
        if value is None or not isinstance(default, (int, float)):
            continue
        try:
            type(default)(value)
        except ValueError:
            raise Exit(f"{name}={value!r}: expected a whole number of seconds (anvil.{key})", 2) from None


def _drop_shadowing_short_flags(context) -> None:
    """Remove auto short flags -h/-H from a task context (they would hide --help/--hosts)."""
    for short in SHORT_FLAGS_KEPT:
        flag = "-" + short
        if flag not in context.flags or short not in context.args.aliases:
            continue   # absent, or a parameter really named `h`: the user asked for it
        arg = context.flags[flag]
        context.flags.unalias(flag)
        context.args.unalias(short)
        arg.names = tuple(n for n in arg.names if n != short)


program = AnvilProgram(
    name="Anvil",
    version=VERSION,
    executor_class=AnvilExecutor,
    config_class=AnvilConfig,
    binary="inv",
    binary_names=["inv", "anvil"],
)
