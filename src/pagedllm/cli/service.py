"""`pagedllm install-service`: a systemd unit that runs `pagedllm serve` as its own user.

Printed by default (read it, then pipe it where you like); `--write` puts it in place and
says the commands that remain (they change the system, so they are shown, not run).
"""
from __future__ import annotations

import os
import shlex
import shutil
import sys

DEFAULT_UNIT_PATH = "/etc/systemd/system/pagedllm.service"


def add_install_service(sub, formatter) -> None:
    service = sub.add_parser(
        "install-service", help="print or write a systemd unit for `pagedllm serve`",
        formatter_class=formatter,
        description="A systemd unit running the server as a dedicated user, reading its options\n"
                    "from a config file, reloading keys on `systemctl reload`, restarted if it\n"
                    "fails. Printed unless --write is given.")
    service.add_argument("--user", default="pagedllm", help="system user the server runs as")
    service.add_argument("--config", default="/etc/pagedllm/pagedllm.toml",
                         help="the config file the service passes to `serve --config`")
    service.add_argument("--state-dir", default="/var/lib/pagedllm",
                         help="the service's writable folder (compiled kernels are cached there)")
    service.add_argument("--shutdown-grace", type=float, default=30.0,
                         help="as the config's shutdown-grace: systemd waits that long and more")
    service.add_argument("--write", default=None, nargs="?", const=DEFAULT_UNIT_PATH,
                         metavar="PATH", help=f"write the unit to PATH ({DEFAULT_UNIT_PATH} "
                                              f"when no PATH is given) (default: print it)")
    service.set_defaults(func=cmd_install_service)


def pagedllm_executable() -> str:
    """This installation's `pagedllm` script (the one the service must run)."""
    beside = os.path.join(os.path.dirname(sys.executable), "pagedllm")
    return beside if os.path.exists(beside) else (shutil.which("pagedllm") or beside)


SYSTEMD_STATE_ROOT = "/var/lib/"


def state_directory_line(state_dir: str) -> str:
    """systemd makes StateDirectory= under /var/lib (owned by the service's user); a state
    folder elsewhere is the admin's to make (next_steps says how), never a second folder."""
    path = os.path.normpath(state_dir)
    if path.startswith(SYSTEMD_STATE_ROOT):
        return f"StateDirectory={path[len(SYSTEMD_STATE_ROOT):]}"
    return f"# {path} is not under {SYSTEMD_STATE_ROOT}: make it, owned by the service's user"


def unit_text(user: str, config: str, state_dir: str, shutdown_grace: float) -> str:
    exec_start = shlex.join([pagedllm_executable(), "serve", "--config", config])
    return f"""[Unit]
Description=pagedllm LLM inference server
Documentation=https://pypi.org/project/pagedllm/
After=network-online.target
Wants=network-online.target

[Service]
Type=simple
User={user}
Group={user}
ExecStart={exec_start}
# SIGHUP re-reads the API key file (`pagedllm keys` sends it too).
ExecReload=/bin/kill -HUP $MAINPID
# SIGTERM drains: running requests get the grace period, /health answers 503 meanwhile.
KillSignal=SIGTERM
TimeoutStopSec={int(shutdown_grace) + 15}
# Exit status 70: the engine became unusable; a fresh process is the cure.
Restart=on-failure
RestartSec=5
Environment=TORCH_EXTENSIONS_DIR={state_dir}/torch_extensions
{state_directory_line(state_dir)}
WorkingDirectory={state_dir}
NoNewPrivileges=true
ProtectSystem=strict
ProtectHome=read-only
PrivateTmp=true
ReadWritePaths={state_dir}

[Install]
WantedBy=multi-user.target
"""


def next_steps(user: str, config: str, unit_path: str, state_dir: str = "/var/lib/pagedllm") -> str:
    folder = os.path.dirname(config)
    state = os.path.normpath(state_dir)
    make_state = "" if state.startswith(SYSTEMD_STATE_ROOT) else \
        f"\n  install -d -o {user} -g {user} {state}"
    return f"""wrote {unit_path}. Then, as root:
  useradd --system --home-dir {state} --shell /usr/sbin/nologin {user}{make_state}
  mkdir -p {folder} && pagedllm serve --print-config > {config}   # edit it
  pagedllm keys --file {folder}/keys.txt add alice                 # key file mode 0600
  chown {user}: {folder}/keys.txt
  (set api-key-file = "{folder}/keys.txt" in {config})
  systemctl daemon-reload && systemctl enable --now {os.path.basename(unit_path)}
  journalctl -u {os.path.basename(unit_path)} -f"""


def cmd_install_service(args) -> int:
    text = unit_text(args.user, args.config, args.state_dir, args.shutdown_grace)
    if args.write is None:
        print(text, end="")
        return 0
    try:
        with open(args.write, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(args.write, 0o644)
    except OSError as exc:
        print(f"error: cannot write {args.write}: {exc.strerror}", file=sys.stderr)
        return 2
    print(next_steps(args.user, args.config, args.write, args.state_dir))
    return 0
