"""One fake per outside boundary (engines, sandbox, ...), shared by the tests."""
