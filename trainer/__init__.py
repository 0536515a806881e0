"""Ringmaster package."""

from ringmaster.guard import check_proto

check_proto()
