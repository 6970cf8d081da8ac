"""settings"""

__all__: list[str] = []
