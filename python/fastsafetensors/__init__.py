from ._ops import ops
