"""diagnosis"""

__all__: list[str] = []
