"""inputs"""

__all__: list[str] = []
