// Tests that make the real registry (SQLite) refuse a write: `sql` (a trigger, say) run on the
// registry's file through a connection of the test's own.
#ifndef MOE_TESTS_CONTROL_REGISTRY_SQL_H_
#define MOE_TESTS_CONTROL_REGISTRY_SQL_H_

#include <string>

#include <sqlite3.h>

#include "gtest/gtest.h"

namespace moe::testing {

inline void RegistrySql(const std::string& path, const std::string& sql) {
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
  char* err = nullptr;
  const int rc = sqlite3_exec(db, sql.c_str(), nullptr, nullptr, &err);
  EXPECT_EQ(rc, SQLITE_OK) << (err != nullptr ? err : "") << ": " << sql;
  sqlite3_free(err);
  sqlite3_close(db);
}

}  // namespace moe::testing

#endif  // MOE_TESTS_CONTROL_REGISTRY_SQL_H_
