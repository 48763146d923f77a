"""A named point in the model where the trace can see a tensor that no module returns."""

from torch import nn


class Probe(nn.Identity):
    """Returns its input unchanged. A forward hook on it (kvbook.tools.trace) records the tensor's shape, or the
    tensor itself (attention weights); with no hook it costs one Python call."""
