"""step"""

__all__: list[str] = []
