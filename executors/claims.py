"""`ClaimTable`: the ops an executor claims, `{op: checker | None}` (docs/executors.md, "Writing an executor")."""

from typing import Callable, Optional

import torch.fx as fx

Checker = Callable[[fx.Node], bool]


class ClaimTable(dict):
    """Ops and, for each, None (claimed as it stands) or a checker `fn(node) -> bool` deciding per node."""

    def register(self, *ops, checker: Optional[Checker] = None) -> None:
        """Claims each of `ops` (OpOverloads or Python callables); `checker`, when given, decides per node."""
        self.update(dict.fromkeys(ops, checker))

    def claims(self, op, node: fx.Node) -> bool:
        return op in self and (self[op] is None or bool(self[op](node)))
