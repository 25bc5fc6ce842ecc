"""Settings: every default of pdproxy (``settings``), and the checks of a ``Settings`` that need the
rest of pdproxy (``checks``)."""
