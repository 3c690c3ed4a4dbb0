"""The front end of the NPU operators: graph patterns, extraction and the pattern-table machinery.

Nothing here imports the codegen; which pattern and extraction serve which
operator is said by :mod:`npu_backend.ops`.
"""

from .table import (PREFIX, Idiom, PartitionContext, Rejection, extract_params, patterns_for,
                    register_table, registered_patterns, required_ops, table_rows)

__all__ = ["PREFIX", "Idiom", "PartitionContext", "Rejection", "extract_params", "patterns_for",
           "register_table", "registered_patterns", "required_ops", "table_rows"]
