"""Rendering: rich tables and pictures. The library never prints; these modules do."""
