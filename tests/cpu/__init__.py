"""CPU tests, in folders that mirror the packages (tests/helpers holds what they share)."""
