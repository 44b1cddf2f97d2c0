"""Integrations with other serving systems."""
