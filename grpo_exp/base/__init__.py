"""Base layer: errors, run files, the machine (threads, precision), resource monitoring, logging, text."""
