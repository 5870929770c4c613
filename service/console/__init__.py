"""The web console (/console): pages served from the package that call the public API from the browser."""
