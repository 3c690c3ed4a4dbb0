"""NPU pattern table, registered in TVM's pattern registry under the prefix ``npu``."""

from .table import (ENTRIES_BY_NAME, OPERATORS, PREFIX, PartitionContext, PatternEntry, Rejection,
                    register_table, registered_patterns, table)

__all__ = ["ENTRIES_BY_NAME", "OPERATORS", "PREFIX", "PartitionContext", "PatternEntry", "Rejection",
           "register_table", "registered_patterns", "table"]
