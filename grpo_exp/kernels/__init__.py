"""Kernels layer: grpo-exp's own CPU compute (attention layouts, C++ decoding kernels, packed products, the
log-prob head, lean saved tensors and reference weights). Each gives the numbers of the path it replaces, or says
where it differs; none reads a config: the speed plan (config/speed.py) decides which run, training/ applies them.
Imports only base/."""
