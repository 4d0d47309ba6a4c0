"""Configuration: :class:`CollectiveConfig` (:mod:`.collective`), where each of its values
comes from (:mod:`.sources`: the environment, a file, :mod:`.launchers`), and the checks and
parsers they share (:mod:`.values`, :mod:`.names`, :mod:`.security`, :mod:`.addresses`)."""

from burncoll.config.collective import CollectiveConfig

__all__ = ["CollectiveConfig"]
