"""Entrypoints: thin mains (Hydra or argparse) over the library; nothing below imports them."""

import os

# Offline machines would otherwise stall on usage pings to the hub (every app loads models or configs).
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
