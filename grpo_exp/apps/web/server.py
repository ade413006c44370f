"""The web app's command line (`python -m grpo_exp.app`, `grpo-app`): its arguments, the login (--auth or
GRPO_APP_AUTH, required for any --host but a loopback one), the checks before Gradio starts (port free,
outputs a folder, gradio installed), and serving the page until Ctrl-C or SIGTERM. On any exit the app stops
the run it started (SIGTERM: it keeps its last checkpoint) and removes its temporary folder (the report's plots
and Gradio's own files)."""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import shutil
import signal
import socket
import sys
from pathlib import Path

from grpo_exp.apps import launch_bounds
from grpo_exp.apps.web.common import EXIT_BAD_INPUT
from grpo_exp.apps.web.page import build
from grpo_exp.apps.web.state import App
from grpo_exp.base import log

logger = log.get_logger(__name__)

DEFAULT_PORT = 7870  # not 7860: `trackio show` takes that one
AUTH_ENV = "GRPO_APP_AUTH"  # USER:PASSWORD, as --auth (an environment variable stays out of `ps`)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m grpo_exp.app",
                                     description="A local web app (Gradio) to launch, watch and compare grpo-exp runs.")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    parser.add_argument("--outputs", default="outputs", help="the folder of runs to browse, where launched runs go "
                                                             "(default: outputs)")
    parser.add_argument("--pass-credentials", action="store_true",
                        help="hand this environment's hub and wandb tokens (HF_TOKEN, WANDB_API_KEY, ...) to the runs "
                             "the app starts, for gated models; without it runs get none, and uploads and online "
                             "logging are never offered from the app")
    parser.add_argument("--auth", default=None, metavar="USER:PASSWORD",
                        help=f"a login for the page and the API (default: ${AUTH_ENV}, else none); needed for any "
                             f"--host but 127.0.0.1 (which every user of this machine reaches)")
    return parser.parse_args(argv)


def parse_auth(text: str | None) -> tuple[str, str] | None:
    """(user, password) from USER:PASSWORD (the password may hold ':'), None for no login."""
    if not text:
        return None
    user, sep, password = text.partition(":")
    if not sep or not user or not password:
        raise ValueError(f"--auth (or {AUTH_ENV}) must be USER:PASSWORD with both parts non-empty")
    return user, password


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def port_in_use(host: str, port: int) -> bool:
    """Whether binding (host, port) fails, checked before Gradio, whose own error spans a traceback."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        auth = parse_auth(args.auth if args.auth is not None else os.environ.get(AUTH_ENV))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if auth is None and not is_loopback(args.host):
        print(f"error: --host {args.host} lets other machines start processes as this user; set a login with "
              f"--auth USER:PASSWORD (or {AUTH_ENV}), or bind 127.0.0.1", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not 0 < args.port < 65536:
        print(f"error: --port {args.port} is not a port number (1-65535)", file=sys.stderr)
        return EXIT_BAD_INPUT
    if port_in_use(args.host, args.port):
        print(f"error: port {args.port} on {args.host} is already in use; choose another with --port", file=sys.stderr)
        return EXIT_BAD_INPUT
    outputs = Path(args.outputs).expanduser().resolve()
    if outputs.exists() and not outputs.is_dir():
        print(f"error: --outputs {outputs} is a file, not a folder", file=sys.stderr)
        return EXIT_BAD_INPUT
    import importlib.util

    if importlib.util.find_spec("gradio") is None:
        print("error: the web app needs gradio, which is not installed; run pip install -e '.[app]' "
              "(make setup does)", file=sys.stderr)
        return EXIT_BAD_INPUT
    log.set_level("INFO")
    # No network here or on many clusters: no analytics pings, and system fonts instead of Google's.
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    app = App(outputs, pass_credentials=args.pass_credentials)
    # Gradio's own files (uploads, cached outputs) go into the app's temporary folder, removed on exit; Gradio
    # reads this when imported, and build() imports it
    os.environ["GRADIO_TEMP_DIR"] = str(app.report_dir / "gradio")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # SIGTERM ends the app as Ctrl-C does: the cleanup below runs
    try:
        demo = build(app)
        demo.queue(default_concurrency_limit=4)
        demo.launch(server_name=args.host, server_port=args.port, prevent_thread_lock=True, quiet=True,
                    ssr_mode=False, show_error=True, allowed_paths=[str(outputs), str(app.report_dir)],
                    theme=_theme(), footer_links=[], auth=auth, max_file_size=launch_bounds.MAX_FILE_SIZE)
        url = f"http://{'[' + args.host + ']' if ':' in args.host else args.host}:{args.port}/"
        print(f"grpo-exp app: {url}  (outputs: {outputs}; Ctrl-C to quit)", flush=True)
        if auth is None:
            logger.info("no login (--auth): every user of this machine can reach %s and start runs", url)
        demo.block_thread()
    except KeyboardInterrupt:
        pass
    finally:
        app.launcher.on_exit()
        with contextlib.suppress(Exception):
            demo.close()
        shutil.rmtree(app.report_dir, ignore_errors=True)
    return 0


def _exit_on_sigterm(signum, frame) -> None:
    raise KeyboardInterrupt


def _theme():
    import gradio as gr

    system = ["ui-sans-serif", "system-ui", "sans-serif"]
    return gr.themes.Default(font=system, font_mono=["ui-monospace", "monospace"])
