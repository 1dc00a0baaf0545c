"""lowlat's own plugins, advertised through the ``lowlat.plugins`` entry-point group."""
