"""ops/common"""
