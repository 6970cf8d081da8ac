"""common"""

__all__: list[str] = []
